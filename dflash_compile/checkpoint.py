"""Quantized checkpoints in the public layouts, written (`quantize`) and loaded with the experts kept packed
(`load_packed`).

    mxfp4      gpt-oss: `{experts}.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16], `..._scales` uint8 [E, 2I, H/32],
               `down_proj_blocks` / `down_proj_scales` [E, H, I/32, ...], biases bf16; everything else unquantized;
               config `quantization_config = {"quant_method": "mxfp4", ...}`
    fp8_block  DeepSeek-V3 / GLM-4.x-FP8 / Qwen3-FP8: the linears transformers' FP8 loading converts but lm_head and
               the routers as float8_e4m3fn `weight` plus fp32 `weight_scale_inv` per 128 x 128 block; routed experts
               per expert in 2-D (`{experts}.{j}.gate_proj.weight`, `up_proj`, `down_proj`, or the family's names:
               Mixtral's w1 / w3 / w2), or stacked in 3-D (`{experts}.gate_up_proj`, `gate_up_proj_scale_inv`) where
               the family's checkpoints stack them; config `quantization_config = {"quant_method": "fp8", "fmt":
               "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
               [...]}`; DeepSeek-V4's release (read, not written): FP4 experts (`expert_dtype` "fp4") and E8M0 scales

transformers dequantizes such checkpoints at load on a CPU; `load_packed` instead builds the model on the meta
device, attaches the routed experts as packed buffers (`packed.attach_packed`), keeps FP8 linear layers as
`FP8Linear` and loads only the rest in the model dtype, so expert memory stays at 4.25 / 8 bits per parameter. As
transformers does, it reads a multimodal checkpoint's text decoder into the causal LM (MULTIMODAL_TEXT_PREFIX) and
skips the tensors the model classes declare skippable (DeepSeek-V3's and GLM-4.5's multi-token-prediction layer,
Qwen3.5's `mtp.*` and vision tower); any other tensor the model does not use is an error.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers.utils.hub import convert_file_size_to_int

from .cost_model import BITS_PER_WEIGHT
from .families import (auto_model_class, builds_causal_lm, experts_modules, first_projection, router_of,
                       spec_for_model)
from .packed import FP8_BLOCK, PackedWeight, attach_packed, expert_weights, packed_weights
from .quant import check_mxfp4_groups, dequantize_fp8_block, quantize_fp8_block

FORMATS = ("mxfp4", "fp8_block")
_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


class FP8Linear(torch.nn.Module):
    """A linear layer kept as float8_e4m3fn bytes + per-128x128-block scales. Its forward dequantizes then multiplies
    (the pattern the `dequant_fusion` pass turns into one fused op)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # uint8 bytes of float8_e4m3fn [out, in]
        self.register_buffer("weight_scale_inv", scale_inv)
        self.register_buffer("bias", bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] dequantized to `dtype`."""
        return torch.ops.dflash.fp8_block_dequantize(self.weight, self.weight_scale_inv, *FP8_BLOCK, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


def _check_quantizable(model: torch.nn.Module, format: str) -> None:
    """Refuse, before any work, an unknown format, a model without a causal LM class, without supported routed
    experts, a format its family has no public layout for, and experts the format cannot hold (MXFP4 groups, FP8
    scale blocks `load_packed` could not read back). Shapes only: `model` may be on the meta device."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    _check_causal_lm(model.config)
    spec = spec_for_model(model)
    if spec is None:
        raise ValueError(f"{type(model).__name__} has no routed experts of a supported family to quantize")
    if (format == "mxfp4") != (spec.name == "gpt_oss"):
        raise ValueError(f"{spec.name} has no public {format} checkpoint layout: use "
                         f"{'mxfp4' if spec.name == 'gpt_oss' else 'fp8_block'} for it")
    for path, experts in experts_modules(model).items():  # shapes only: an offloaded model's weights stay on disk
        weights = expert_weights(experts)
        if format == "mxfp4":
            for weight in weights:
                check_mxfp4_groups(weight.shape[-1], f"{path}: ")
        elif _gated(experts):
            _check_fp8_stackable(path, weights[0].shape[1] // 2)


@contextlib.contextmanager
def _weights_in_memory(module: torch.nn.Module):
    """The module's own weights readable: loaded from disk where accelerate's offload (`quantize_checkpoint`'s load)
    keeps them on the meta device, as they are otherwise."""
    if getattr(module, "_hf_hook", None) is None:
        yield
        return
    from accelerate.utils import align_module_device

    with align_module_device(module, "cpu"):
        yield


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's own parameters and persistent buffers (its part of the state dict)."""
    yield from ((name, parameter.detach()) for name, parameter in module.named_parameters(recurse=False))
    yield from ((name, buffer) for name, buffer in module.named_buffers(recurse=False)
                if name not in module._non_persistent_buffers_set)


def _quantized_experts(experts: torch.nn.Module, format: str,
                       names: tuple[str, str, str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """An experts module's tensors in `format`'s public layout, by their names under the module (`names`: the
    family's per-expert projections, gate, up and down; None: FP8 stacked as the module holds them, with
    `_scale_inv` grids, as transformers' FP8Experts reads them)."""
    first, gated = first_projection(experts), _gated(experts)
    replaced = {first, "down_proj", f"{first}_bias", "down_proj_bias"}
    yield from ((name, tensor) for name, tensor in _own_tensors(experts) if name not in replaced)
    gate_up, down = expert_weights(experts)
    if format == "mxfp4":
        for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            packed = PackedWeight.quantize(weight.data, "mxfp4")
            yield from ((f"{name}_blocks", packed.data), (f"{name}_scales", packed.scales),
                        (f"{name}_bias", weight.bias))
        return
    if names is None:
        for name, weight in ((first, gate_up), ("down_proj", down)):
            packed = PackedWeight.quantize(weight.data, "fp8_block")
            yield from ((name, packed.data.view(torch.float8_e4m3fn)), (f"{name}_scale_inv", packed.scales))
        return
    for j in range(gate_up.shape[0]):
        rows = gate_up.data[j].chunk(2, dim=0) if gated else (gate_up.data[j],)
        for name, weight in (*zip(_first_projections(names, gated), rows), (names[2], down.data[j])):
            quantized, scale = quantize_fp8_block(weight, FP8_BLOCK)
            yield from ((f"{j}.{name}.weight", quantized), (f"{j}.{name}.weight_scale_inv", scale))


def _quantized_tensors(model: torch.nn.Module, format: str, kept: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, module by module (each module's weights in memory only while it is read, for a
    model offloaded to disk): routed experts in `format`; with fp8_block also the linears transformers' FP8 loading
    converts (`_fp8_in_transformers`) but those `kept` in the model's dtype (`_unquantized_fp8_linears`); everything
    else as it is."""
    names, layers = _expert_projection_names(model), experts_modules(model)
    head = model.get_output_embeddings()
    tied_head = head if model.config.tie_word_embeddings else None
    progress = tqdm(total=len(layers), desc="quantizing experts", unit="layer", disable=len(layers) < 8)
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        with _weights_in_memory(module):
            if path in layers:  # a full-size layer takes seconds to round on a CPU
                tensors = _quantized_experts(module, format, names)
            elif format == "fp8_block" and _fp8_in_transformers(model, path, module) and path not in kept:
                quantized, scale = quantize_fp8_block(module.weight.detach(), FP8_BLOCK)
                tensors = [("weight", quantized), ("weight_scale_inv", scale),
                           *((name, tensor) for name, tensor in _own_tensors(module) if name != "weight")]
            else:
                tensors = _own_tensors(module)
            yield from ((prefix + name, tensor) for name, tensor in tensors
                        if tensor is not None and not (module is tied_head and name == "weight"))  # stored once
        if path in layers:
            progress.update()
    progress.close()


def _fp8_in_transformers(model: torch.nn.Module, path: str, module: torch.nn.Module) -> bool:
    """Whether transformers' FP8 loading makes `module` an FP8 layer (`replace_with_fp8_linear`): a plain nn.Linear or
    a grouped one (DeepSeek-V4's `o_a_proj`), outside the modules the model class keeps in fp32 (DeepSeek-V4's
    compressor and indexer projections, which its release ships in bf16). A checkpoint that quantizes other layers,
    or leaves these, is one transformers reads wrongly (a weight's scale unexpected, or missing)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    linear = type(module) is torch.nn.Linear or (isinstance(module, torch.nn.Linear)
                                                 and "GroupedLinear" in type(module).__name__)
    return linear and should_convert_module(path, model._keep_in_fp32_modules)


def _unquantized_fp8_linears(model: torch.nn.Module) -> list[str]:
    """The linears transformers' FP8 loading converts that an fp8_block checkpoint keeps in the model's dtype: the
    output head, the routers' (Hunyuan-A13B's fp32 `gate.wg`; Phi-MoE's router is an nn.Linear subclass; routing stays
    in the model's dtype, as released FP8 keeps it) and the family's `unquantized_linears` (weights its code multiplies
    directly or takes its compute dtype from, routers beside the MoE blocks'). `quantize` names them in the config's
    `modules_to_not_convert`, as FP8 releases do, so transformers' FP8 loading leaves them unquantized too."""
    unquantized = spec_for_model(model).unquantized_linears
    routers = {part for path in experts_modules(model) for part in router_of(model, path).modules()}
    head = model.get_output_embeddings()
    return [path for path, module in model.named_modules() if _fp8_in_transformers(model, path, module)
            and (module is head or module in routers or path.endswith(unquantized))]


# The default largest shard, as transformers' `save_pretrained` wrote them before 5.0: the Hub takes files up to
# 50 GB (gpt-oss-120b's MXFP4 experts alone are 61 GB), and safetensors serialises a file's tensors in memory
# before writing it, so a shard is what `quantize` holds at most.
SHARD_SIZE = "5GB"


def quantize(model: torch.nn.Module, directory: str | Path, format: str,
             max_shard_size: int | str = SHARD_SIZE) -> Path:
    """Write `model` as a quantized checkpoint in the public layout of `format` ("mxfp4" for gpt-oss,
    "fp8_block" for the other families) -- model.safetensors, or shards of at most `max_shard_size` (bytes, or
    `save_pretrained`'s "5GB" / "500MB") with their index as transformers writes them -- with its config and
    generation config. Tensors go out as each module is quantized, so memory holds one shard beside the model (and,
    for a model offloaded to disk, one module's weights: `quantize_checkpoint`). Returns the directory."""
    largest = shard_bytes(max_shard_size)
    _check_quantizable(model, format)
    directory = Path(directory)
    kept = _unquantized_fp8_linears(model) if format == "fp8_block" else []
    with _made_for_this(directory), _Shards(directory, largest) as shards:
        for name, tensor in _quantized_tensors(model, format, set(kept)):
            shards.add(name, tensor)
    config = model.config.to_dict()
    config["quantization_config"] = _MXFP4_CONFIG if format == "mxfp4" else (
        _FP8_CONFIG | {"modules_to_not_convert": kept})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(directory)
    return directory


def quantize_checkpoint(source: str | Path, directory: str | Path, format: str,
                        dtype: torch.dtype = torch.bfloat16, max_shard_size: int | str = SHARD_SIZE) -> Path:
    """`quantize` a bf16 / fp32 checkpoint (a directory or a Hub repo id) without holding the model in memory: it
    loads offloaded to disk (transformers' `device_map` with accelerate: its checkpoint conversions, e.g. per-expert
    tensors stacked into `gate_up_proj`, and the family's own, DBRX's experts moved (`_adapt_offloaded`), written to
    a scratch folder inside `directory`, removed after), then each module's weights are read, quantized and written
    in turn. Peak host memory: about one shard (`max_shard_size`: smaller shards, less memory) and one layer's
    experts in `dtype`; scratch disk: about the converted and moved tensors' size."""
    shard_bytes(max_shard_size)  # a bad size is refused before the load
    source = checkpoint_directory(source)
    config = transformers.AutoConfig.from_pretrained(source)
    method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    if method:
        raise ValueError(f"{source} is a {method} checkpoint already: quantize takes a bf16 or fp32 one")
    _check_quantizable(_meta_model(config), format)  # before the load, which writes the scratch folder
    directory = Path(directory)
    with _made_for_this(directory), tempfile.TemporaryDirectory(dir=directory, prefix=".offload-") as scratch:
        model = auto_model_class(config).from_pretrained(source, dtype=dtype, device_map={"": "disk"},
                                                         offload_folder=scratch)
        _adapt_offloaded(model)
        return quantize(model, directory, format, max_shard_size)


def _adapt_offloaded(model: torch.nn.Module) -> None:
    """The family's adapters that make new weights from the old (DBRX's experts, `Adapter.moves_weights`) run on a
    model offloaded to disk a module at a time: the module's weights read in, rewritten, and the new ones written
    to accelerate's offload folder and offloaded there as the rest are (meta parameters, read back by a hook on
    their module: `_weights_in_memory`), so memory holds one module's weights at a time, as `quantize` then does."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import PrefixedDataset, offload_weight, set_module_tensor_to_device

    for adapter in [adapter for adapter in spec_for_model(model).adapt if adapter.moves_weights]:
        for prefix, module in [(name, module) for name, module in model.named_modules() if adapter.pending(module)]:
            before = {f"{prefix}.{name}" for name, _ in module.named_parameters()}
            offloading = next(part._hf_hook for part in module.modules()
                              if getattr(getattr(part, "_hf_hook", None), "weights_map", None) is not None)
            loader = offloading.weights_map.dataset  # the model's offloaded weights, by full name
            with contextlib.ExitStack() as loaded:
                for part in module.modules():
                    loaded.enter_context(_weights_in_memory(part))
                adapter.rewrite(model, module)
                made = {path: part for path, part in module.named_modules(prefix=prefix)
                        if any(f"{path}.{name}" not in before for name, _ in part.named_parameters(recurse=False))}
                for path, part in made.items():  # while the context holds them: leaving it may offload to meta
                    for name, weight in list(part.named_parameters(recurse=False)):
                        offload_weight(weight.data, f"{path}.{name}", loader.save_folder, index=loader.index)
                        set_module_tensor_to_device(part, name, "meta")
            for path, part in made.items():
                add_hook_to_module(part, AlignDevicesHook(offloading.execution_device, offload=True,
                                                          weights_map=PrefixedDataset(loader, f"{path}.")))


def _meta_model(config, dtype: torch.dtype | None = None) -> transformers.PreTrainedModel:
    """The config's model built on the meta device: its modules' names and shapes, no memory."""
    with torch.device("meta"):
        return auto_model_class(config).from_config(config, dtype=dtype)


@contextlib.contextmanager
def _made_for_this(directory: Path):
    """The directory, created if missing, and removed again if it was and the work inside fails (a weight holding
    NaN shows only as its layer is rounded): a failed quantization leaves no half-written checkpoint behind."""
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise


def _check_causal_lm(config) -> None:
    """`load_packed` builds a quantized checkpoint as transformers' causal LM of its config: refuse, before any work,
    a model type that has none (Qwen3-VL-MoE is an image-text-to-text model only)."""
    if not builds_causal_lm(config):
        raise ValueError(f"model_type {config.model_type!r} has no causal LM class in transformers, which quantized "
                         "checkpoints load as: run this model unquantized (optimize) or with its experts offloaded "
                         "(offload_experts)")


_INDEX = "model.safetensors.index.json"


def shard_bytes(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a size as `save_pretrained` takes it ("5GB", "500MB", "2GiB")."""
    try:
        size = convert_file_size_to_int(max_shard_size)
    except ValueError:
        size = 0
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB' or '500MB', "
                         f"got {max_shard_size!r}")
    return size


class _Shards:
    """Tensors written as they come, in files of at most `max_bytes` (a larger tensor alone in one), named
    on a clean close as `save_pretrained` names them: model.safetensors, or model-0000i-of-0000n.safetensors with
    their index. Only then are the weight files of a checkpoint written there before removed, so the two never mix,
    and a failure leaves the old one as it was (its own files removed)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[list[str]] = []  # the tensor names of each written file

    def __enter__(self) -> _Shards:
        return self

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._write()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _write(self) -> None:
        save_file(self.pending, str(self._part(len(self.files))), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _part(self, index: int) -> Path:
        return self.directory / f"model-part-{index}.safetensors.partial"  # no weight file's name until complete

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            if self.pending or not self.files:
                self._write()
            for old in (*self.directory.glob("model*.safetensors"), self.directory / _INDEX):
                old.unlink(missing_ok=True)
        count = len(self.files)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for index, name in enumerate(names):
            if error_type is None:
                self._part(index).rename(self.directory / name)
            else:  # a failed write leaves no partial checkpoint behind
                self._part(index).unlink(missing_ok=True)
        if error_type is None and count > 1:
            weight_map = {tensor: name for name, tensors in zip(names, self.files) for tensor in tensors}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / _INDEX).write_text(json.dumps(index, indent=2))


# Where a multimodal checkpoint (e.g. Qwen3.5-MoE's image-text-to-text release) keeps its text decoder, which the
# causal LM built from its config names "model.": transformers' PrefixChange of the same name. (Gemma 4's causal LM
# class is its multimodal model, which keeps the stored names.)
MULTIMODAL_TEXT_PREFIX = ("model.language_model.", "model.")


class _Checkpoint:
    """Every tensor of a checkpoint directory, read lazily by the name the model gives it: as stored, for a
    multimodal checkpoint's text decoder also by the causal LM's name (MULTIMODAL_TEXT_PREFIX), and with `model`
    also by the names transformers' loading gives it (`_model_names`: DeepSeek-V4's release names)."""

    def __init__(self, directory: Path, model: torch.nn.Module | None = None):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory} has no *.safetensors weights")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        stored, loaded = MULTIMODAL_TEXT_PREFIX
        self.where = {key: (handle, key) for handle in self.handles for key in handle.keys()}
        self.where |= {loaded + key.removeprefix(stored): place for key, place in self.where.items()
                       if key.startswith(stored)}
        if model is not None:  # the names above come first, where a renaming would reach one of them
            names_of = _model_names(model)
            self.where = {name: place for key, place in self.where.items() for name in names_of(key)} | self.where
        self.used: set[str] = set()  # stored names

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def taken(self, key: str) -> bool:
        """Whether the tensor `key` names was read already (packed experts, FP8 layers)."""
        return key in self.where and self.where[key][1] in self.used

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(f"the checkpoint has no tensor {key!r}")
        handle, stored = self.where[key]
        self.used.add(stored)
        return handle.get_tensor(stored)

    def unused(self, model: torch.nn.Module, config) -> list[str]:
        """Tensors not loaded, but for those transformers skips too: the patterns of the model's class and of the
        checkpoint's own (`config.architectures`; multi-token-prediction layers, a multimodal model's other
        towers)."""
        classes = [type(model), *(getattr(transformers, name, None) for name in config.architectures or [])]
        patterns = [re.compile(pattern) for cls in classes
                    for pattern in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []]
        return sorted({stored for _, stored in self.where.values()
                       if stored not in self.used and not any(p.search(stored) for p in patterns)})


def _model_names(model: torch.nn.Module):
    """stored key -> the model's names for it, as transformers' loading renames it: the family's renamings
    (`conversion_mapping`: DeepSeek-V4's release says `layers.3.attn.wq_a.weight` for
    `model.layers.3.self_attn.q_a_proj.weight`) with the base model's prefix where the key lacks it; a stored
    `.scale` also as an FP8 block scale, `.weight_scale_inv` (transformers' FP8 quantizer's renaming, before the
    family's). The merges of per-expert tensors are left out: the experts are read per expert (`_packed_experts`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    children = dict(model.named_children())

    def model_name(key: str) -> str:
        key = apply_renamings(key, renamings)
        if key.split(".")[0] not in children and model.base_model_prefix in children:
            key = f"{model.base_model_prefix}.{key}"
        return key

    def model_names(key: str) -> list[str]:
        scale = [model_name(key.removesuffix(".scale") + ".weight_scale_inv")] if key.endswith(".scale") else []
        return [model_name(key), *scale]

    return model_names


def checkpoint_format(config: dict) -> tuple[str, bool]:
    """(the packed format of a checkpoint's routed experts, whether its linear layers are FP8) from its config (a
    config.json's dict): gpt-oss MXFP4; FP8 blocks (DeepSeek-V3 style), or with `expert_dtype` "fp4" (in the
    quantization config or beside it: DeepSeek-V4's release) MXFP4 experts beside the FP8 linears."""
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method == "mxfp4":
        return "mxfp4", False
    if method == "fp8":
        if list(quantization.get("weight_block_size") or []) != list(FP8_BLOCK):
            raise ValueError(f"FP8 checkpoint with weight_block_size {quantization.get('weight_block_size')}: "
                             f"only {list(FP8_BLOCK)} blocks are supported")
        experts = quantization.get("expert_dtype", config.get("expert_dtype")) or "fp8"
        if experts not in _FP8_CHECKPOINT_EXPERTS:
            raise ValueError(f"FP8 checkpoint with expert_dtype {experts!r}: dflash-compile loads "
                             f"{sorted(_FP8_CHECKPOINT_EXPERTS)} experts")
        return _FP8_CHECKPOINT_EXPERTS[experts], True
    raise ValueError(f"quantization_config quant_method {method!r} is not a packed format dflash-compile loads "
                     f"({FORMATS}); load the model with transformers instead")


# An FP8 checkpoint's `expert_dtype` -> the experts' packed format (FP4: e2m1 pairs per byte, an E8M0 scale per 32
# along K: MXFP4's values)
_FP8_CHECKPOINT_EXPERTS = {"fp8": "fp8_block", "fp4": "mxfp4"}


def refuse_hub_kernel_experts(model: torch.nn.Module) -> None:
    """Refuse experts that transformers loaded from an MXFP4 checkpoint with its hub kernels (`Mxfp4GptOssExperts`,
    wherever the `kernels` package is installed, which transformers 5.25 requires): their weights are in a layout
    only those kernels read, so dflash could neither pack nor run them. The error names the loads dflash runs."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    hub = [name for name, module in model.named_modules() if isinstance(module, Mxfp4GptOssExperts)]
    if hub:
        directory = getattr(model.config, "_name_or_path", "") or "the checkpoint"
        raise ValueError(
            f"{hub[0]} ({len(hub)} experts modules in all) holds experts transformers loaded with its MXFP4 hub "
            "kernels (Mxfp4GptOssExperts), in a layout only those kernels read; load with "
            f"dflash_compile.from_pretrained({directory!r}) (experts kept packed, dflash's fused kernels) or pass "
            "transformers quantization_config=Mxfp4Config(dequantize=True)")


def refuse_weights_outside_the_model(model: torch.nn.Module) -> None:
    """Refuse a model whose weights are not in its parameters: loaded with an accelerate `device_map` that offloads
    to the CPU or disk or spans several devices (its offloaded weights wait on the meta device for hooks that move
    them in layer by layer), or never loaded (meta parameters). dflash's graphs and kernels read the parameters: the
    error names the load that keeps them there and the offload that does the device_map's job."""
    placed = sorted({str(device) for device in (getattr(model, "hf_device_map", None) or {}).values()})
    missing = sum(parameter.is_meta for parameter in model.parameters())
    if len(placed) > 1 or missing:
        where = f"loaded with device_map over {placed}" if placed else "not loaded"
        why = (f"{missing} of its parameters are on the meta device (accelerate keeps offloaded weights outside the "
               "model and moves them in with hooks), where dflash_compile cannot read them" if missing
               else "dflash_compile runs a model on one device")
        raise ValueError(
            f"{type(model).__name__} was {where}: {why}. Load it on one device without device_map and let "
            "dflash_compile offload the routed experts within a GPU budget: dflash_compile.from_pretrained(path, "
            "gpu_memory='20GiB'), or optimize(model, gpu_memory='20GiB') on a model loaded to the CPU")


def adopt_transformers_fp8(model: torch.nn.Module) -> None:
    """Take over the modules transformers' FP8 loading builds on a GPU (`integrations.finegrained_fp8`), keeping their
    bytes: each `FP8Experts` becomes the family's own experts module with its weights attached packed (FP8 blocks, or
    DeepSeek-V4's FP4 rows as MXFP4), each `FP8Linear` of 128 x 128 blocks dflash's (`FP8Linear`: the `dequant_fusion`
    pass's pattern), and a grouped one (DeepSeek-V4's `o_a_proj`) has its weight dequantized in place, which its
    forward then multiplies as the bf16 layer does. Without this the family's experts are not found (transformers'
    class stands in their place) and the model is refused as an unsupported family. Every new module is built
    before any is put in: a refusal leaves the model as it was."""
    from transformers.integrations import finegrained_fp8 as hf

    modules = list(model.named_modules())
    replaced = {name: _family_experts(model, name, module) for name, module in modules
                if isinstance(module, hf.FP8Experts)}
    replaced |= {name: FP8Linear(module.weight.view(torch.uint8), _scales(module.weight_scale_inv, "fp8_block"),
                                 module.bias) for name, module in modules
                 if type(module) is hf.FP8Linear and tuple(module.block_size) == FP8_BLOCK}
    for name, module in replaced.items():
        _set(model, name, module)
    for module in (module for _, module in modules if isinstance(module, hf.FP8GroupedLinear)):
        scales = _scales(module.weight_scale_inv, "fp8_block")
        module.weight = torch.nn.Parameter(dequantize_fp8_block(module.weight, scales, tuple(module.block_size),
                                                                model.dtype), requires_grad=False)


def _family_experts(model: torch.nn.Module, name: str, fp8: torch.nn.Module) -> torch.nn.Module:
    """The family's experts module (its class from the MoE block's modeling module, built from the FP8 module's config)
    holding `fp8`'s weights packed, on their device."""
    block = model.get_submodule(name.rpartition(".")[0])
    class_name = spec_for_model(model).experts_class
    experts_class = getattr(sys.modules[type(block).__module__], class_name, None)
    try:
        with torch.device("meta"):
            experts = experts_class(fp8.config)
    except TypeError:  # absent (Llama 4's are dflash's own), or built from more than the config (Ling's layer index)
        raise ValueError(f"{name}: transformers' FP8Experts stands where {class_name} belongs, which dflash cannot "
                         "build again from the config; load the checkpoint with dflash_compile.from_pretrained(path), "
                         "which keeps its experts packed") from None
    first = "gate_up_proj" if fp8.has_gate else "up_proj"
    left = [part for part, tensor in (*experts.named_parameters(), *experts.named_buffers())
            if tensor.is_meta and part not in (first, "down_proj")]
    if left:
        raise ValueError(f"{name}: the family's experts module has {left} beside the weights transformers' FP8Experts "
                         "holds; load the checkpoint with dflash_compile.from_pretrained(path) instead")
    attach_packed(experts, *(_packed_stack(getattr(fp8, part), getattr(fp8, f"{part}_scale_inv"))
                             for part in (first, "down_proj")))
    return experts


def pack_experts_expanded_at_load(model: torch.nn.Module) -> None:
    """Undo transformers' expansion of an MXFP4 / FP8 checkpoint's routed experts: without its own kernels it loads
    them in the model dtype and drops `quantization_config` (the checkpoint's config.json still names the format).
    MXFP4 experts are packed again in place -- their values are MXFP4 values, so packing them is lossless, which is
    checked before anything changes; otherwise (FP8: arbitrary block scales) a warning names the packed load."""
    config_file = Path(getattr(model.config, "_name_or_path", "") or ".") / "config.json"
    modules = experts_modules(model)
    if not config_file.is_file() or any(hasattr(m, "packed_format") for m in modules.values()):
        return
    try:
        format, _ = checkpoint_format(json.loads(config_file.read_text()))
    except ValueError:  # not quantized, or in a format dflash-compile does not pack
        return
    packed = {name: _lossless_mxfp4(m) for name, m in modules.items()} if format == "mxfp4" else {}
    if packed and all(p is not None for p in packed.values()):
        for name, module in modules.items():
            attach_packed(module, *packed[name])
        return
    directory = str(config_file.parent)
    warnings.warn(f"{directory}: transformers expanded the checkpoint's {format} routed experts to {model.dtype} at "
                  f"load ({BITS_PER_WEIGHT[format]:.2f} -> {torch.finfo(model.dtype).bits} bits per weight); "
                  f"dflash_compile.from_pretrained({directory!r}) keeps them packed and runs them with the fused "
                  "kernels", stacklevel=3)


def _lossless_mxfp4(experts: torch.nn.Module) -> tuple[PackedWeight, PackedWeight] | None:
    """The module's (gate_up, down) packed as MXFP4 if that reproduces every weight exactly, else None (NaN or inf
    weights too: no code holds them, and the quantizer refuses them)."""
    packed = []
    with torch.no_grad():
        for weight in expert_weights(experts):
            if not torch.isfinite(weight.data).all():
                return None
            quantized = PackedWeight.quantize(weight.data, "mxfp4", weight.bias)
            if not torch.equal(quantized.dequantize(weight.data.dtype), weight.data):
                return None
            packed.append(quantized)
    return tuple(packed)


def _check_fp8_stackable(path: str, intermediate: int) -> None:
    """FP8 experts stay packed as one [2I, H] gate/up weight, so gate's and up's 128-row scale blocks must not
    straddle the seam between them."""
    if intermediate % FP8_BLOCK[0]:
        raise ValueError(f"{path}: expert intermediate size {intermediate} is not a multiple of {FP8_BLOCK[0]}, so "
                         "gate and up scale blocks cannot be stacked into one [2I, H] weight: this model's experts "
                         "cannot be kept packed in fp8_block; keep them in bf16")


# A per-expert projection's name in the patterns of transformers' converters that stack experts
# (`.experts.*.w1.weight`, `mlp.experts.*.gate_proj.weight`, DeepSeek-V4's `\.experts.*.w1.weight`)
_PER_EXPERT_PATTERN = re.compile(r"experts\\?\.\*\\?\.(\w+)\\?\.weight$")


def _expert_projection_names(model: torch.nn.Module) -> tuple[str, str, str] | None:
    """The names a checkpoint gives each routed expert's (gate, up, down) projections, `{experts}.{j}.{name}.weight`:
    those transformers' conversion mapping stacks into the experts' `gate_up_proj` (or `up_proj`) and `down_proj`
    (Mixtral's, MiniMax's, Phi-MoE's, Kimi Linear's, LFM2-MoE's and DeepSeek-V4's w1, w3 and w2). None where it
    stacks none: the family's checkpoints hold its experts stacked (Gemma 4, the Granite MoEs, Inkling, ZAYA1), and so
    do FP8 ones, as its FP8Experts reads them; per-expert gate_proj, up_proj, down_proj for families whose experts are
    stored [E, in, out] (Aria, Llama 4: FP8Experts holds [E, out, in])."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    found = {}
    for converter in get_model_conversion_mapping(model):
        target = converter.target_patterns[-1] if isinstance(converter, WeightConverter) else ""
        names = [match[1] for source in converter.source_patterns if (match := _PER_EXPERT_PATTERN.search(source))]
        if names and target.endswith(("gate_up_proj", "down_proj")):
            found[target.endswith("down_proj")] = names
    if not found and not spec_for_model(model).layout.transposed:
        return None
    gate_up, down = found.get(False, ["gate_proj", "up_proj"]), found.get(True, ["down_proj"])
    return (*gate_up, *down) if len(gate_up) == 2 and len(down) == 1 else ("gate_proj", "up_proj", "down_proj")


def _first_projections(names: tuple[str, str, str], gated: bool) -> tuple[str, ...]:
    """The checkpoint's per-expert projections the experts' first weight stacks, of the family's (gate, up, down)
    `names`: gate and up, or up alone for experts without a gate (Nemotron-H)."""
    return names[:2] if gated else names[1:2]


def _gated(experts: torch.nn.Module) -> bool:
    """Whether the experts' first projection holds gate and up rows (not up alone: Nemotron-H)."""
    return first_projection(experts) == "gate_up_proj"


def _packed_experts(checkpoint: _Checkpoint, path: str, format: str, experts: int, gated: bool,
                    names: tuple[str, str, str] | None, device) -> tuple[PackedWeight, ...]:
    """An experts module's (gate_up, down) from the checkpoint: gpt-oss's stacked MXFP4 blocks, stacked FP8 (or FP4)
    weights with their `_scale_inv` grids, or each expert's projections (`names`: gate, up, down; `gated` False: up
    alone first, Nemotron-H) as FP8 blocks or as FP4 rows (two e2m1 codes a byte, low nibble first, an E8M0 scale per
    32: MXFP4's bytes, regrouped)."""
    stacked = ("gate_up_proj" if gated else "up_proj", "down_proj")
    if f"{path}.{stacked[0]}_scale_inv" in checkpoint:
        return tuple(_packed_stack(checkpoint.get(f"{path}.{name}").to(device),
                                   checkpoint.get(f"{path}.{name}_scale_inv").to(device)) for name in stacked)
    if f"{path}.gate_up_proj_blocks" in checkpoint:
        return tuple(PackedWeight("mxfp4", checkpoint.get(f"{path}.{name}_blocks").to(device),
                                  checkpoint.get(f"{path}.{name}_scales").to(device),
                                  checkpoint.get(f"{path}.{name}_bias").to(device) if f"{path}.{name}_bias"
                                  in checkpoint else None) for name in ("gate_up_proj", "down_proj"))
    names = names or ("gate_proj", "up_proj", "down_proj")
    first, down = _first_projections(names, gated), names[2]
    parts = {name: [(checkpoint.get(f"{path}.{j}.{name}.weight"), checkpoint.get(f"{path}.{j}.{name}.weight_scale_inv"))
                    for j in range(experts)] for name in (*first, down)}
    if gated and format == "fp8_block":
        _check_fp8_stackable(path, parts[first[0]][0][0].shape[0])

    def stack(names):
        data = torch.stack([torch.cat([_packed_rows(parts[n][j][0], format) for n in names]) for j in range(experts)])
        scales = torch.stack([torch.cat([_scales(parts[n][j][1], format) for n in names]) for j in range(experts)])
        return PackedWeight(format, data.to(device), scales.to(device))

    return stack(first), stack((down,))


def _packed_stack(weight: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """Experts stacked [E, N, K] as transformers' FP8Experts holds them: FP8 bytes with their block scales, or int8
    FP4 pairs with E8M0 scales per 32 as MXFP4."""
    format = "mxfp4" if weight.dtype == torch.int8 else "fp8_block"
    return PackedWeight(format, _packed_rows(weight, format), _scales(scales, format))


def _packed_rows(weight: torch.Tensor, format: str) -> torch.Tensor:
    """Stored projection rows as PackedWeight data: FP8 bytes [..., N, K], or FP4 pairs [..., N, K/2] grouped by 32
    codes, [..., N, K/32, 16]."""
    data = weight.view(torch.uint8)
    if format == "mxfp4":
        check_mxfp4_groups(2 * data.shape[-1])
        return data.reshape(*data.shape[:-1], -1, 16)
    return data


def _scales(scales: torch.Tensor, format: str) -> torch.Tensor:
    """Stored scales as PackedWeight scales: MXFP4's E8M0 bytes; FP8's fp32 factors, from fp32 or from E8M0
    (`scale_fmt` "ue8m0": float8_e8m0fnu, or raw bytes, each 2^(byte - 127))."""
    if format == "mxfp4":
        return scales.view(torch.uint8)
    if scales.dtype == torch.uint8:
        return torch.exp2(scales.float() - 127)
    return scales.float()


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def checkpoint_directory(path: str | Path) -> Path:
    """`path` when it is a directory; else a Hugging Face Hub repo id, whose top-level files (config, safetensors
    weights, tokenizer; not the copies in subfolders, such as gpt-oss's original/ and metal/ weights) are fetched
    into the Hub cache, or found there when offline."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory nor a Hugging Face Hub repo id") from None
    return Path(snapshot_download(str(path), ignore_patterns=["*/*"]))


def load_packed(path: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> transformers.PreTrainedModel:
    """A quantized checkpoint (gpt-oss MXFP4 or FP8 block-scaled; a directory or a Hub repo id) with routed experts
    kept packed: MXFP4 at 4.25 bits and FP8 at 8 bits per parameter. FP8 linear layers stay FP8 (`FP8Linear`); the
    rest is loaded in `dtype`."""
    path = checkpoint_directory(path)
    config = transformers.AutoConfig.from_pretrained(path)
    format, fp8_linears = checkpoint_format(config.to_dict())
    del config.quantization_config
    _check_causal_lm(config)
    model = _meta_model(config, dtype)
    checkpoint = _Checkpoint(path, model)
    names = _expert_projection_names(model)
    for name, experts in experts_modules(model).items():
        count = experts.down_proj.shape[0]
        attach_packed(experts, *_packed_experts(checkpoint, name, format, count, _gated(experts), names, device))
    if fp8_linears:
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale_inv" in checkpoint:
                _load_fp8_linear(model, name, module, checkpoint, device)
    _load_remaining(model, checkpoint, device)
    unused = checkpoint.unused(model, config)
    if unused:
        raise ValueError(f"{path} has tensors the model does not use: {unused[:5]} ({len(unused)} in all); is it a "
                         f"{config.model_type} checkpoint in the {format} layout?")
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model.eval()


def _load_fp8_linear(model: torch.nn.Module, name: str, module: torch.nn.Linear, checkpoint: _Checkpoint,
                     device) -> None:
    """The FP8 layer `name` kept FP8 (`FP8Linear`), or, where the layer's own forward reads its `weight` (DeepSeek-V4's
    grouped output projection), its weight dequantized into it in the model's dtype."""
    dtype = module.weight.dtype
    bias = checkpoint.get(f"{name}.bias").to(device, dtype) if module.bias is not None else None
    fp8 = FP8Linear(checkpoint.get(f"{name}.weight").view(torch.uint8).to(device),
                    _scales(checkpoint.get(f"{name}.weight_scale_inv"), "fp8_block").to(device), bias)
    if type(module).forward is torch.nn.Linear.forward:
        _set(model, name, fp8)
        return
    module.weight = torch.nn.Parameter(fp8.dense_weight(dtype), requires_grad=False)
    if bias is not None:
        module.bias = torch.nn.Parameter(bias, requires_grad=False)


def _load_remaining(model: torch.nn.Module, checkpoint: _Checkpoint, device) -> None:
    """Every parameter and buffer still on the meta device from the checkpoint, except buffers the checkpoint does
    not hold (rotary tables), which the model's own initialisation computes; tied weights tied again."""
    output = model.get_output_embeddings()
    tied = model.config.tie_word_embeddings and output is not None
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if any(b.is_meta and prefix + n not in checkpoint for n, b in module.named_buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)  # then the checkpoint overwrites what it holds
            model._init_weights(module)
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                key = prefix + name
                if tensor is None or key not in checkpoint or checkpoint.taken(key) or (tied and module is output):
                    continue  # absent, or already taken (packed experts, FP8 layers)
                value = checkpoint.get(key)  # in the dtype the model gave it (transformers' fp32-kept modules)
                value = value.to(device, tensor.dtype if value.is_floating_point() else value.dtype)
                table[name] = torch.nn.Parameter(value, requires_grad=False) if table is module._parameters else value
    if tied:
        model.tie_weights()
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise ValueError(f"the checkpoint left {left[:5]} uninitialised ({len(left)} in all)")


# bytes per element of the dtypes quantized checkpoints store their experts in, by safetensors' names
_STORED_BYTES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F16": 2, "BF16": 2, "F32": 4}


def stored_expert_bytes(path: str | Path) -> tuple[int, int]:
    """`expert_bytes` of a quantized checkpoint read from its tensors' headers and its config, no tensor loaded (the
    quantize command's summary, which loading the checkpoint would cost its whole size in memory)."""
    path = checkpoint_directory(path)
    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = _meta_model(config)
    layers = experts_modules(model)
    parameters = sum(weight.data.numel() for experts in layers.values() for weight in expert_weights(experts))
    # by the model's names (a multimodal checkpoint's stored ones too: `_Checkpoint`), each stored tensor once
    experts = {place for key, place in _Checkpoint(path, model).where.items()
               if not key.endswith(("_bias", ".bias")) and any(key.startswith(f"{name}.") for name in layers)}
    total = 0
    for handle, key in experts:
        view = handle.get_slice(key)
        total += math.prod(view.get_shape()) * _STORED_BYTES[view.get_dtype()]
    return total, parameters


def expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the routed experts' packed weights and scales, their weight count); biases not counted."""
    total, parameters = 0, 0
    for experts in experts_modules(model).values():
        for weight in packed_weights(experts):
            total += weight.nbytes() - (weight.bias.numel() * weight.bias.element_size() if weight.bias is not None
                                        else 0)
            experts_count, rows, columns = weight.shape
            parameters += experts_count * rows * columns
    return total, parameters
