"""Quantized checkpoints in the public layouts: written by `quantize`, loaded packed by `load_packed`."""

import json
import re
import warnings

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.models.dbrx.configuration_dbrx import DbrxFFNConfig

import dflash_compile
from dflash_compile import checkpoint
from dflash_compile.offload import plan_offload
from dflash_compile.checkpoint import (FP8Linear, expert_bytes, load_packed, quantize, quantize_checkpoint,
                                       stored_expert_bytes)
from dflash_compile.families import adapt_model, experts_modules, first_projection, router_of, spec_for_model
from dflash_compile.packed import packed_weights
from dflash_compile.testing import load_tiny_model, save_release, save_tiny_model
from tests.conftest import FAMILIES, token_ids

# Expert sizes the formats can hold: MXFP4 groups of 32, FP8 gate/up stacked in whole 128-row blocks.
SIZES = {"gpt_oss": {"intermediate_size": 64}, "deepseek_v2": {"moe_intermediate_size": 128},
         "deepseek_v3": {"moe_intermediate_size": 128}, "ernie4_5_moe": {"moe_intermediate_size": 128},
         "dots1": {"moe_intermediate_size": 128}, "exaone_moe": {"moe_intermediate_size": 128},
         "flex_olmo": {"intermediate_size": 128}, "solar_open": {"moe_intermediate_size": 128},
         "granitemoe": {"intermediate_size": 128}, "granitemoeshared": {"intermediate_size": 128},
         "cohere2_moe": {"intermediate_size": 128}, "minimax_m2": {"intermediate_size": 128},
         "hunyuan_v1_moe": {"intermediate_size": 128}, "hy_v3": {"moe_intermediate_size": 128},
         "laguna": {"moe_intermediate_size": 128}, "mimo_v2_flash": {"moe_intermediate_size": 128},
         "afmoe": {"moe_intermediate_size": 128}, "gemma4_text": {"moe_intermediate_size": 128},
         "phimoe": {"intermediate_size": 128}, "granitemoe_swa": {"intermediate_size": 128},
         "mixtral": {"intermediate_size": 128}, "olmoe": {"intermediate_size": 128},
         "aria": {"intermediate_size": 128}, "llama4_text": {"intermediate_size": 128},
         "granitemoehybrid": {"intermediate_size": 128}, "jamba": {"intermediate_size": 128},
         "jetmoe": {"intermediate_size": 128}, "ergo": {"moe_intermediate_size": 128},
         "minimax": {"intermediate_size": 128}, "zaya": {"moe_intermediate_size": 128},
         "minimax_m3_vl": {"intermediate_size": 128}, "inkling": {"moe_intermediate_size": 128},
         "inkling2": {"moe_intermediate_size": 128}, "inkling2_loop": {"moe_intermediate_size": 128},
         **{family: {"moe_intermediate_size": 128}
            for family in ("mellum", "kolibri1", "kolibri1_1", "beam", "flint", "minicpm5_moe", "axk1", "lara_mini",
                           "mistral4", "kimi_linear", "bailing_hybrid", "lfm2_moe", "nemotron_h", "longcat_flash",
                           "deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note", "hy_v4", "deepseek_v4")},
         "glm4_moe": {"moe_intermediate_size": 128}, "glm4_moe_lite": {"moe_intermediate_size": 128},
         "qwen2_moe": {"moe_intermediate_size": 128}, "qwen3_moe": {"moe_intermediate_size": 128},
         "qwen3_next": {"moe_intermediate_size": 128},
         "dbrx": {"ffn_config": DbrxFFNConfig(hidden_size=64, ffn_hidden_size=128, moe_num_experts=8, moe_top_k=2,
                                              moe_normalize_expert_weights=1.0)}}


def _quantized(family, format, tmp_path, **options):
    model = load_tiny_model(family, directory=save_tiny_model(family, tmp_path / "bf16", **SIZES[family]))
    return model, quantize(model, tmp_path / format, format, **options)


def _transformers_dequantized_load(directory):
    """transformers' own load of an MXFP4 checkpoint, its experts dequantized (transformers 5.24 does so on a CPU
    by itself; 5.25 would fetch its hub kernels unless asked)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))


def test_mxfp4_gpt_oss_loads_packed_and_matches_transformers_dequantized_load(tmp_path):
    _, directory = _quantized("gpt_oss", "mxfp4", tmp_path)
    packed = load_packed(directory, dtype=torch.float32)
    weight_bytes, weights = expert_bytes(packed)
    assert weight_bytes * 8 / weights == 4.25
    assert packed_weights(packed.model.layers[0].mlp.experts)[0].data.dtype == torch.uint8
    assert not hasattr(packed.model.layers[0].mlp.experts, "gate_up_proj")  # never expanded
    reference = _transformers_dequantized_load(directory)  # an independent reading of the same checkpoint
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_large_checkpoints_are_written_in_shards_both_loaders_read(tmp_path):
    """Above `max_shard_size` a checkpoint goes out in shards with transformers' index; writing again into the same
    directory (in one file at the default 5 GB) replaces the old weight files rather than mixing with them."""
    model, directory = _quantized("gpt_oss", "mxfp4", tmp_path, max_shard_size="100KB")
    shards = sorted(path.name for path in directory.glob("*.safetensors"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(load_packed(directory, dtype=torch.float32)(ids).logits,
                                   _transformers_dequantized_load(directory)(ids).logits, atol=1e-5, rtol=1e-5)
    quantize(model, directory, "mxfp4")
    assert [path.name for path in directory.glob("*.safetensors*")] == ["model.safetensors"]
    load_packed(directory)


def test_optimize_packs_again_the_mxfp4_experts_transformers_expanded_at_load(tmp_path):
    """The issue's own example: `AutoModelForCausalLM.from_pretrained` of an MXFP4 checkpoint expands the experts
    (asked to, as transformers 5.24 does on a CPU anyway) and drops quantization_config; optimize packs them again,
    losslessly, so the fused MXFP4 kernel runs them and generation is unchanged."""
    _, directory = _quantized("gpt_oss", "mxfp4", tmp_path)
    model = _transformers_dequantized_load(directory).eval()
    ids = token_ids()
    with torch.no_grad():
        logits = model(ids).logits
    expected = model.generate(ids, do_sample=False, max_new_tokens=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = dflash_compile.optimize(model, compile=False)
    assert not [w for w in caught if "expanded" in str(w.message)]
    experts = model.model.layers[0].mlp.experts
    assert experts.packed_format == "mxfp4" and not hasattr(experts, "gate_up_proj")
    weight_bytes, weights = expert_bytes(model)
    assert weight_bytes * 8 / weights == 4.25
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.generate(ids, max_new_tokens=8), expected)


def test_expanded_mxfp4_experts_that_do_not_pack_again_keep_their_dtype_with_a_warning(tmp_path):
    """Expanded experts MXFP4 cannot reproduce (here one NaN weight, which no code holds and the quantizer refuses)
    are left in the model's dtype: optimize warns and names the packed load rather than raising."""
    _, directory = _quantized("gpt_oss", "mxfp4", tmp_path)
    model = _transformers_dequantized_load(directory).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[0, 0, 0] = torch.nan
    with pytest.warns(UserWarning, match=r"transformers expanded the checkpoint's mxfp4 routed experts"):
        dflash_compile.optimize(model, compile=False)
    assert not hasattr(model.model.layers[0].mlp.experts, "packed_format")


def test_experts_on_transformers_mxfp4_hub_kernels_are_refused_naming_the_loads_that_work(tmp_path):
    """transformers with the `kernels` package (a dependency from 5.25) loads an MXFP4 checkpoint into its hub
    kernels' experts (`Mxfp4GptOssExperts`, swizzled weights); optimize refuses them before changing anything."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP

    _, directory = _quantized("gpt_oss", "mxfp4", tmp_path)
    model = _transformers_dequantized_load(directory)
    for layer in model.model.layers:  # as transformers' replace_with_mxfp4_linear swaps them in
        layer.mlp = Mxfp4GptOssMLP(layer.mlp.router, Mxfp4GptOssExperts(model.config))
    before = {name: type(module) for name, module in model.named_modules()}
    message = (rf"model.layers.0.mlp.experts \({len(model.model.layers)} experts modules in all\) holds experts "
               rf"transformers loaded with its MXFP4 hub kernels .* dflash_compile.from_pretrained\('{directory}'\) "
               r".* quantization_config=Mxfp4Config\(dequantize=True\)")
    with pytest.raises(ValueError, match=message):
        dflash_compile.optimize(model, compile=False)
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_optimize_names_the_packed_load_when_transformers_expanded_fp8_experts(tmp_path):
    """FP8 block scales are arbitrary, so expanded FP8 experts cannot be packed again exactly: a warning names the
    load that keeps them packed."""
    _, directory = _quantized("deepseek_v3", "fp8_block", tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    message = (rf"{directory}: transformers expanded the checkpoint's fp8_block routed experts to torch.float32 at "
               rf"load \(8.00 -> 32 bits per weight\); dflash_compile.from_pretrained\('{directory}'\) keeps them "
               "packed")
    with pytest.warns(UserWarning, match=message):
        dflash_compile.optimize(model, compile=False)


def _dequantized_reference(original, packed):
    """The original model with every packed tensor replaced by its reference dequantization (the packed model's own
    weight where it was dequantized at load)."""
    reference = adapt_model(load_tiny_model(original.config.model_type, directory=original.name_or_path))  # as packed
    transposed = spec_for_model(reference).layout.transposed  # as transformers' modules, even Llama 4's, hold them
    for (name, module), (_, source) in zip(reference.named_modules(), packed.named_modules()):
        if isinstance(source, FP8Linear):
            weight = torch.ops.dflash.fp8_block_dequantize(source.weight, source.weight_scale_inv, 128, 128,
                                                           torch.float32)
            module.weight.data.copy_(weight)
        elif hasattr(source, "packed_format"):  # packed [E, out, in]; Aria's and Llama 4's modules hold [E, in, out]
            stored = (lambda weight: weight.transpose(1, 2)) if transposed else (lambda weight: weight)
            gate_up, down = packed_weights(source)
            getattr(module, first_projection(module)).data.copy_(stored(gate_up.dequantize()))
            module.down_proj.data.copy_(stored(down.dequantize()))
        elif isinstance(source, torch.nn.Linear):  # DeepSeek-V4's grouped FP8 projection is dequantized at load
            module.weight.data.copy_(source.weight)
    return reference


# gpt-oss's checkpoints are MXFP4 (tests above); Qwen3.5-MoE's FP8 one is tested as released (image-text, below)
def test_deepseek_v4s_fp4_release_loads_packed_and_matches_transformers_load(tmp_path):
    """DeepSeek-V4's release layout (`save_release`: its stored names, FP4 experts, FP8 linears with E8M0
    scales): experts kept at 4.25 bits, FP8 linears kept FP8 but the grouped output projection (its forward reads
    its weight: dequantized at load), and logits as transformers' own load of the checkpoint (which dequantizes it
    all on a CPU); `from_pretrained`'s tokens are that model's, resident and offloaded (MXFP4 blobs: the release's
    284B parameters need it). That load's experts are FP4 values: `optimize` packs them again, losslessly. An expert
    dtype the release layout has no reading for is refused by name."""
    directory = save_release("deepseek_v4", tmp_path / "release", **SIZES["deepseek_v4"])
    packed = load_packed(directory, dtype=torch.float32)
    weight_bytes, weights = expert_bytes(packed)
    assert weight_bytes * 8 / weights == 4.25 and stored_expert_bytes(directory) == (weight_bytes, weights)
    attention = packed.model.layers[1].self_attn
    assert isinstance(attention.q_a_proj, FP8Linear) and isinstance(attention.o_b_proj, FP8Linear)
    assert type(attention.o_a_proj).__name__ == "DeepseekV4GroupedLinear"
    assert attention.o_a_proj.weight.dtype == torch.float32
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    fast = dflash_compile.from_pretrained(directory, dtype=torch.float32, device="cpu")
    assert torch.equal(fast.generate(ids, max_new_tokens=8), expected)
    plan = plan_offload(packed, "cpu")  # MXFP4 blobs, three slots beyond one layer's experts
    offloaded = dflash_compile.from_pretrained(directory, dtype=torch.float32, device="cpu",
                                               gpu_memory=plan.minimum_budget + 3 * plan.blob_bytes)
    assert torch.equal(offloaded.generate(ids, max_new_tokens=8), expected)
    assert offloaded.model.dflash_offload.stats.misses > 0
    repacked = dflash_compile.optimize(reference)
    assert all(hasattr(m, "packed_format") for m in experts_modules(repacked.model).values())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"expert_dtype": "nvfp4"}))
    with pytest.raises(ValueError, match=r"FP8 checkpoint with expert_dtype 'nvfp4': dflash-compile loads "
                                         r"\['fp4', 'fp8'\] experts"):
        load_packed(directory)


def test_a_mixtral_fp8_release_by_its_stored_names_loads_packed_and_matches_transformers_load(tmp_path):
    """Mixtral's FP8 releases keep its original names (`block_sparse_moe.experts.{j}.w1.weight` with
    `weight_scale_inv`; `save_release`), which the loader reads as transformers renames them: experts at 8 bits,
    attention FP8, logits as transformers' own load of the checkpoint."""
    directory = save_release("mixtral", tmp_path / "release", expert_dtype="fp8", **SIZES["mixtral"])
    with safe_open(str(directory / "model.safetensors"), framework="pt") as stored:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight_scale_inv" in stored.keys()
    packed = load_packed(directory, dtype=torch.float32)
    weight_bytes, weights = expert_bytes(packed)
    assert 8.0 <= weight_bytes * 8 / weights <= 8.01
    assert isinstance(packed.model.layers[0].self_attn.q_proj, FP8Linear)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4", "hunyuan_v1_moe", "jamba", "granitemoe"])
def test_optimize_takes_over_what_transformers_fp8_load_on_a_gpu_builds(family, tmp_path, monkeypatch):
    """transformers' FP8 loading on a GPU (here on the CPU, its environment check skipped) puts its own FP8Experts
    and FP8Linear in the family's places; `optimize` refused such a model as an unsupported family. It takes them
    over with their bytes (`adopt_transformers_fp8`): logits as `load_packed`'s model of the same checkpoint, and the
    same tokens; DeepSeek-V4's FP4 experts become MXFP4, its grouped FP8 output projection is dequantized in place.
    Our files name the linears they keep unquantized in `modules_to_not_convert` (Hunyuan-A13B's router `gate.wg`,
    Jamba's `dt_proj`), which transformers' load otherwise made FP8 layers with scales missing, and hold the experts
    of a family whose checkpoints stack them stacked (the Granite MoEs; transformers' CPU load, which dequantizes
    only the per-expert tensors its converters stack, reads these scales as unexpected)."""
    from transformers.integrations import finegrained_fp8
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    directory = (save_release(family, tmp_path / "release", **SIZES[family]) if family == "deepseek_v4"
                 else _quantized(family, "fp8_block", tmp_path)[1])
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *args, **kwargs: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert any(isinstance(m, finegrained_fp8.FP8Experts) for m in model.modules())
    fast = dflash_compile.optimize(model)
    hf_modules = (finegrained_fp8.FP8Experts, finegrained_fp8.FP8Linear)
    assert not any(type(m) in hf_modules for m in model.modules())
    assert {m.packed_format for m in experts_modules(model).values()} == {
        "mxfp4" if family == "deepseek_v4" else "fp8_block"}
    reference, ids = load_packed(directory, dtype=torch.float32), token_ids(batch=1)
    with torch.no_grad():  # the same weights (Jamba's scan rounds differently in the two models: 1.5e-7)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-6, rtol=1e-6)
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(fast.generate(ids, max_new_tokens=8), expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v4"])
def test_transformers_reads_our_fp8_block_checkpoints_as_load_packed_does(family, tmp_path):
    """Our fp8_block files in the names transformers' loading stacks experts from (Qwen3's gate_proj / up_proj /
    down_proj, Mixtral's and DeepSeek-V4's w1 / w3 / w2; `_expert_projection_names`) and with its FP8 layers
    (`_fp8_in_transformers`): transformers' own load (dequantizing on a CPU) gives `load_packed`'s logits."""
    _, directory = _quantized(family, "fp8_block", tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(load_packed(directory, dtype=torch.float32)(ids).logits, reference(ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_transformers_fp8_experts_dflash_cannot_rebuild_are_refused_naming_the_packed_load(tmp_path, monkeypatch):
    """Llama 4's experts module is dflash's own (`adapt_model` makes it), not a class of transformers' to rebuild
    from the config: the takeover names the load that works instead, and leaves the model as transformers built
    it."""
    from transformers.integrations import finegrained_fp8
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    _, directory = _quantized("llama4_text", "fp8_block", tmp_path)
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *args, **kwargs: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model.layers.1.feed_forward.experts: transformers' FP8Experts stands "
                                         r"where Llama4RoutedExperts belongs, which dflash cannot build again from the "
                                         r"config; load the checkpoint with dflash_compile.from_pretrained\(path\)"):
        dflash_compile.optimize(model)
    assert type(model.model.layers[0].self_attn.q_proj) is finegrained_fp8.FP8Linear


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in ("gpt_oss", "qwen3_5_moe")])
def test_fp8_block_checkpoint_loads_packed_and_matches_the_dequantized_model(family, tmp_path):
    original, directory = _quantized(family, "fp8_block", tmp_path)
    packed = load_packed(directory, dtype=torch.float32)
    weight_bytes, weights = expert_bytes(packed)
    assert 8.0 <= weight_bytes * 8 / weights <= 8.01  # one fp32 scale per 128 x 128 block
    assert any(isinstance(m, FP8Linear) for m in packed.modules())
    routers = {part for path in experts_modules(packed) for part in router_of(packed, path).modules()}
    # every plain linear is FP8 but lm_head, the routers' (Hunyuan-A13B's fp32 gate.wg; Phi-MoE's router), those
    # the family's code multiplies by their weight (Jamba's dt_proj) or reads the dtype of, and those the model class
    # keeps in fp32, as transformers' FP8 loading does (DeepSeek-V4's compressor projections)
    unquantized = spec_for_model(packed).unquantized_linears
    assert not any(type(m) is torch.nn.Linear and m is not packed.lm_head and m not in routers
                   and not name.endswith(unquantized) and should_convert_module(name, packed._keep_in_fp32_modules)
                   for name, m in packed.named_modules())
    assert not any(isinstance(m, FP8Linear) for m in routers)
    reference = _dequantized_reference(original, packed)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, format", [("gpt_oss", "mxfp4"), ("deepseek_v3", "fp8_block")])
def test_packed_models_compile_and_generate(family, format, tmp_path):
    _, directory = _quantized(family, format, tmp_path)
    packed = load_packed(directory, dtype=torch.float32)
    ids = token_ids()
    report = dflash_compile.explain(packed, ids)
    assert report.graph_break_count == 0
    assert f"resident on cpu, {format}" in report.expert_placement
    assert report.matches["expert_dispatch"] == len(dflash_compile.FAMILIES[family].moe_layers(packed.config))
    assert report.matches["dequant_fusion"] == sum(isinstance(m, FP8Linear) for m in packed.modules())
    after = "\n".join(graph.after for graph in report.graphs)
    assert "dflash.moe_dispatch" in after and "packed_moe" not in after and "fp8_block_dequantize" not in after
    # the packed buffers stay graph inputs (the caller passes them) but nothing reads them: the store owns them
    assert all(line.endswith("= input") for line in after.splitlines() if "packed_gate_up_data" in line)
    with torch.no_grad():
        expected = packed(ids).logits
        actual = torch.compile(packed, backend="dflash")(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    fast = dflash_compile.optimize(packed)
    assert torch.equal(fast.generate(ids[:1], max_new_tokens=6),
                       packed.generate(ids[:1], max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_fp8_latent_attention_steps_dequantize_kv_b_proj_instead_of_expanding_the_cache(family, tmp_path,
                                                                                       monkeypatch):
    """An FP8 kv_b_proj (DeepSeek-V3's own checkpoints) is dequantized once a step for attention in the latent
    space: no step expands the cache through it; the same tokens as the packed model's `generate`."""
    _, directory = _quantized(family, "fp8_block", tmp_path)
    packed = load_packed(directory, dtype=torch.float32)
    layer_class = type(packed.model.layers[0].self_attn)
    expand_kv, expanded = layer_class.expand_kv, []
    monkeypatch.setattr(layer_class, "expand_kv", lambda layer, kv_nope, k_rot: expanded.append(kv_nope.shape[2])
                        or expand_kv(layer, kv_nope, k_rot))
    ids = token_ids()[:1]
    with torch.no_grad():
        expected = packed.generate(ids, max_new_tokens=6, do_sample=False)
    expanded.clear()
    assert isinstance(packed.model.layers[0].self_attn.kv_b_proj, FP8Linear)
    assert torch.equal(dflash_compile.optimize(packed, compile=False).generate(ids, max_new_tokens=6), expected)
    assert len(expanded) == packed.config.num_hidden_layers  # the unmasked prompt's prefill only


def test_checkpoints_load_by_hub_repo_id(tmp_path, monkeypatch):
    """A Hugging Face Hub repo id instead of a directory: `dflash_compile.from_pretrained` resolves it through
    huggingface_hub (here offline, from a Hub cache laid out as huggingface_hub writes it) and loads the MXFP4
    checkpoint packed, as from its directory. A path that is neither a directory nor a repo id is named."""
    import huggingface_hub

    from dflash_compile.checkpoint import checkpoint_directory

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-gpt-oss"
    model = load_tiny_model("gpt_oss", directory=save_tiny_model("gpt_oss", tmp_path / "m", **SIZES["gpt_oss"]))
    snapshot = quantize(model, repo / "snapshots" / commit, "mxfp4")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert checkpoint_directory("someone/tiny-gpt-oss") == snapshot.resolve()
    by_id = dflash_compile.from_pretrained("someone/tiny-gpt-oss", dtype=torch.float32, device="cpu", compile=False)
    by_directory = dflash_compile.from_pretrained(snapshot, dtype=torch.float32, device="cpu", compile=False)
    assert packed_weights(by_id.model.model.layers[0].mlp.experts)[0].data.dtype == torch.uint8  # kept packed
    ids = token_ids()[:1]
    assert torch.equal(by_id.generate(ids, max_new_tokens=6), by_directory.generate(ids, max_new_tokens=6))
    with pytest.raises(FileNotFoundError, match="is neither a checkpoint directory nor a Hugging Face Hub repo id"):
        checkpoint_directory(tmp_path / "nowhere")


def _stored(directory):
    """Every tensor of a checkpoint directory, by name, whatever its shards."""
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


@pytest.mark.parametrize("family, format", [("gpt_oss", "mxfp4")] + [
    (family, "fp8_block") for family in FAMILIES if family not in ("gpt_oss", "qwen3_5_moe")])
def test_a_checkpoint_quantized_from_disk_is_the_one_quantized_in_memory(family, format, tmp_path, monkeypatch):
    """`quantize_checkpoint` loads the bf16 checkpoint offloaded to disk (transformers converting the families'
    stored layouts, e.g. stacking Qwen3's per-expert tensors) and reads a module at a time: while one layer's experts
    are rounded, every other layer's stay on the meta device. Its shards hold the tensors of `quantize` on the model
    loaded whole, bit for bit, and the scratch folder is gone."""
    source = save_tiny_model(family, tmp_path / "bf16", **SIZES[family])
    whole = quantize(load_tiny_model(family, torch.bfloat16, directory=source), tmp_path / "whole", format)
    models, resident = [], []
    monkeypatch.setattr(checkpoint, "quantize", lambda model, *args: models.append(model) or quantize(model, *args))
    quantized_experts = checkpoint._quantized_experts

    def watched(experts, *args):
        resident.append([path for path, module in experts_modules(models[0]).items()
                         if not getattr(module, first_projection(module)).is_meta])
        yield from quantized_experts(experts, *args)

    monkeypatch.setattr(checkpoint, "_quantized_experts", watched)
    streamed = quantize_checkpoint(source, tmp_path / "streamed", format, max_shard_size=20_000)
    layers = list(experts_modules(models[0]))
    assert resident == [[path] for path in layers]
    expected, written = _stored(whole), _stored(streamed)
    assert len(list(streamed.glob("model-*.safetensors"))) > 1 and sorted(written) == sorted(expected)
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    assert sorted(path.name for path in streamed.iterdir() if path.name.startswith(".")) == []
    assert stored_expert_bytes(streamed) == expert_bytes(load_packed(streamed))  # the quantize command's summary
    assert json.loads((streamed / "config.json").read_text()) == json.loads((whole / "config.json").read_text())


def test_a_failed_quantization_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """A NaN weight shows only as its layer is rounded, after other shards went out: the old checkpoint in the
    directory stays whole and a new directory is removed again; an already quantized source, a format the family
    has no layout for and an unknown one are refused before the load."""
    source = save_tiny_model("qwen3_moe", tmp_path / "bf16", **SIZES["qwen3_moe"])
    out = quantize_checkpoint(source, tmp_path / "out", "fp8_block")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    broken = load_tiny_model("qwen3_moe", torch.bfloat16, directory=source)
    with torch.no_grad():
        broken.model.layers[-1].mlp.experts.down_proj[0, 0, 0] = torch.nan
    broken.save_pretrained(tmp_path / "broken")
    for directory in (out, tmp_path / "new"):
        with pytest.raises(ValueError, match="the weight holds NaN or infinite values, which FP8 cannot represent"):
            quantize_checkpoint(tmp_path / "broken", directory, "fp8_block")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"out is a fp8 checkpoint already: quantize takes a bf16 or fp32 one"):
        quantize_checkpoint(out, tmp_path / "again", "fp8_block")
    monkeypatch.setattr(checkpoint.tempfile, "TemporaryDirectory", None)  # the load's scratch: never reached
    with pytest.raises(ValueError, match="qwen3_moe has no public mxfp4 checkpoint layout: use fp8_block"):
        quantize_checkpoint(source, tmp_path / "again", "mxfp4")
    with pytest.raises(ValueError, match=r"format must be one of \('mxfp4', 'fp8_block'\), got 'int4'"):
        quantize_checkpoint(source, tmp_path / "again", "int4")
    for size in ("5 gigabytes", "-1GB", 0):
        with pytest.raises(ValueError, match=rf"max_shard_size must be a positive number of bytes or a size such as "
                                             rf"'5GB' or '500MB', got {size!r}"):
            quantize_checkpoint(source, tmp_path / "again", "fp8_block", max_shard_size=size)
    assert not (tmp_path / "again").exists()


def test_format_errors_name_the_fix(tmp_path):
    model = load_tiny_model("gpt_oss", directory=save_tiny_model("gpt_oss", tmp_path / "m", **SIZES["gpt_oss"]))
    with pytest.raises(ValueError, match="gpt_oss has no public fp8_block checkpoint layout: use mxfp4"):
        quantize(model, tmp_path / "q", "fp8_block")
    with pytest.raises(ValueError, match=r"format must be one of \('mxfp4', 'fp8_block'\)"):
        quantize(model, tmp_path / "q", "int4")
    with pytest.raises(ValueError, match="quant_method None is not a packed format"):
        load_packed(tmp_path / "m")
    odd = load_tiny_model("gpt_oss", directory=save_tiny_model("gpt_oss", tmp_path / "odd"))  # I = 48
    with pytest.raises(ValueError, match="MXFP4 groups of 32 need the last dimension divisible by 32, got 48"):
        quantize(odd, tmp_path / "q2", "mxfp4")
    narrow = load_tiny_model("qwen3_moe", directory=save_tiny_model("qwen3_moe", tmp_path / "narrow"))  # I = 32
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts: expert intermediate size 32 is not a multiple "
                                         r"of 128, so gate and up scale blocks cannot be stacked"):
        quantize(narrow, tmp_path / "q3", "fp8_block")  # a checkpoint load_packed would refuse
    assert not (tmp_path / "q2").exists() and not (tmp_path / "q3").exists()


def test_packed_models_of_one_class_compile_to_their_own_experts(tmp_path):
    """As for resident experts (tests/test_backend.py): a graph that expert_dispatch bound to one packed model's
    experts must not serve another model of the same class."""
    models = []
    for seed in (0, 1):
        bf16 = load_tiny_model("gpt_oss", directory=save_tiny_model("gpt_oss", tmp_path / f"bf16-{seed}", seed=seed,
                                                                    **SIZES["gpt_oss"]))
        models.append(load_packed(quantize(bf16, tmp_path / f"mxfp4-{seed}", "mxfp4"), dtype=torch.float32))
    ids = token_ids()
    with torch.no_grad():
        for packed in models:
            torch.testing.assert_close(torch.compile(packed, backend="dflash")(ids).logits, packed(ids).logits,
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, skipped", [("deepseek_v3", "model.layers.61.eh_proj.weight"),
                                             ("glm4_moe", "model.layers.46.eh_proj.weight"),
                                             ("glm4_moe_lite", "model.layers.47.eh_proj.weight")])
def test_fp8_checkpoints_load_past_the_tensors_transformers_skips(family, skipped, tmp_path):
    """Released DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash FP8 checkpoints carry a multi-token-prediction layer past the
    last decoder layer, which transformers skips (`_keys_to_ignore_on_load_unexpected`): so does load_packed; any
    other stray tensor is still refused."""
    from safetensors.torch import save_file

    _, directory = _quantized(family, "fp8_block", tmp_path)
    plain = load_packed(directory, dtype=torch.float32)
    save_file({skipped: torch.zeros(4, 4)}, str(directory / "mtp.safetensors"))
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(load_packed(directory, dtype=torch.float32)(ids).logits, plain(ids).logits)
    save_file({"model.layers.0.stray.weight": torch.zeros(4, 4)}, str(directory / "stray.safetensors"))
    with pytest.raises(ValueError, match=r"has tensors the model does not use: \['model.layers.0.stray.weight'\]"):
        load_packed(directory)


def test_a_multimodal_fp8_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5-MoE as released (image-text-to-text: the decoder under `model.language_model`, a vision tower beside
    it) quantized to FP8 loads as the causal LM transformers' AutoModelForCausalLM gives, the tower left out: the
    same logits as the FP8 checkpoint of that causal LM."""
    from dflash_compile.testing import tiny_multimodal_config

    config = tiny_multimodal_config("qwen3_5_moe", hidden_size=128, moe_intermediate_size=128,
                                    shared_expert_intermediate_size=128)  # whole 128-wide FP8 blocks
    torch.manual_seed(0)
    multimodal = transformers.AutoModelForImageTextToText.from_config(config).eval()
    multimodal.save_pretrained(tmp_path / "bf16")
    causal = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    loaded = load_packed(quantize(multimodal, tmp_path / "multimodal", "fp8_block"), dtype=torch.float32)
    expected = load_packed(quantize(causal, tmp_path / "causal", "fp8_block"), dtype=torch.float32)
    assert type(loaded) is type(expected) is transformers.Qwen3_5MoeForCausalLM
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_gemma4_as_released_loads_its_fp8_checkpoint_by_the_stored_names(tmp_path):
    """Gemma 4's causal LM class is its image-text-to-text model, which keeps the checkpoint's names
    (`model.language_model.`), not the text-only causal LM's: quantized to FP8 it loads packed as that model, its
    logits those of the model with every packed tensor dequantized."""
    from dflash_compile.testing import tiny_multimodal_config

    torch.manual_seed(0)
    config = tiny_multimodal_config("gemma4", moe_intermediate_size=128)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "bf16")
    original = load_tiny_model("gemma4", directory=tmp_path / "bf16")
    assert type(_fp8_packed_as_dequantized(original, tmp_path / "fp8")) is transformers.Gemma4ForConditionalGeneration


def _fp8_packed_as_dequantized(original, directory):
    """`original` quantized to FP8 in `directory` and loaded packed, checked to hold 8 bits an expert weight and to
    give the logits of the model with every packed tensor dequantized."""
    packed = load_packed(quantize(original, directory, "fp8_block"), dtype=torch.float32)
    weight_bytes, weights = expert_bytes(packed)
    assert 8.0 <= weight_bytes * 8 / weights <= 8.01
    reference = _dequantized_reference(original, packed)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    return packed


def test_qwen4_exp_causal_lm_loads_its_fp8_checkpoint_packed(tmp_path):
    """Qwen4-Exp's causal LM (its release's decoder; whole 128-wide FP8 blocks) quantized to FP8 loads packed at 8 bits
    an expert weight, its logits those of the model with every packed tensor dequantized (its n-gram embeddings,
    hyper-connections and indexers kept as they are)."""
    from dflash_compile.testing import tiny_multimodal_config

    torch.manual_seed(0)
    config = tiny_multimodal_config("qwen4_exp", hidden_size=128, moe_intermediate_size=128,
                                    shared_expert_intermediate_size=128, ple_embed_dim=128).text_config
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bf16")
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert type(_fp8_packed_as_dequantized(original, tmp_path / "fp8")) is transformers.Qwen4ExpForCausalLM


def test_a_model_type_without_a_causal_lm_is_refused_before_anything_is_written(tmp_path):
    """Quantized checkpoints load as transformers' causal LM of their config; Qwen3-VL-MoE has none (an
    image-text-to-text model only), so quantize refuses it before writing, and load_packed a checkpoint of it."""
    from dflash_compile.testing import tiny_multimodal_config

    config = tiny_multimodal_config("qwen3_vl_moe", moe_intermediate_size=128)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    message = ("model_type 'qwen3_vl_moe' has no causal LM class in transformers, which quantized checkpoints load "
               "as: run this model unquantized (optimize) or with its experts offloaded (offload_experts)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        quantize(model, tmp_path / "q", "fp8_block")
    assert not (tmp_path / "q").exists()
    model.save_pretrained(tmp_path / "unquantized")
    config = json.loads((tmp_path / "unquantized" / "config.json").read_text())
    (tmp_path / "unquantized" / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_packed(tmp_path / "unquantized")


def test_a_model_whose_device_map_keeps_weights_outside_it_is_refused(tmp_path):
    """accelerate's device_map offload (here to disk, and to the CPU and disk) leaves parameters on the meta device:
    optimize and offload_experts refuse before changing anything, naming the map and the load that works; so does a
    split over two GPUs; a device_map of one device keeps the weights in the model and runs."""
    directory = save_tiny_model("qwen3_moe", tmp_path / "model")
    ids = token_ids()
    for budget in ("200KB", "400KB"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path / "offload"),
            dtype=torch.float32)
        placed = sorted(set(model.hf_device_map.values()))
        implementation = model.config._experts_implementation
        refused = rf"^Qwen3MoeForCausalLM was loaded with device_map over {re.escape(str(placed))}: \d+ of its "
        refused += r"parameters are on the meta device .* dflash_compile.from_pretrained\(path, gpu_memory='20GiB'\)"
        for call in (dflash_compile.optimize, lambda m: dflash_compile.offload_experts(m, "1GB", "cpu")):
            with pytest.raises(ValueError, match=refused):
                call(model)
        assert model.config._experts_implementation == implementation
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cpu", dtype=torch.float32)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # as accelerate records a split over two GPUs
    with pytest.raises(ValueError, match=r"over \['0', '1'\]: dflash_compile runs a model on one device\. Load it"):
        dflash_compile.optimize(model)
    model.hf_device_map = {"": "cpu"}
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(dflash_compile.optimize(model, compile=False).generate(ids, max_new_tokens=8), expected)
