"""`optimize(model, drafter=...)`: the one call that gives a model the dflash passes and speculative generation."""

from __future__ import annotations

import inspect

import torch

from .adaptive import WidthChooser
from .checkpoint import (adopt_transformers_fp8, pack_experts_expanded_at_load, refuse_hub_kernel_experts,
                         refuse_weights_outside_the_model)
from .drafter import load_drafter
from .families import adapt_model, spec_for_model, supported_families, text_causal_lm
from .linear_attention import check_verify_block
from .offload import offload_experts
from .projections import share_storage
from .speculative import GenerationStats, SpeculativeDecoder


class OptimizedModel:
    """A model with a dflash-compiled forward and greedy (optionally speculative) `generate`."""

    def __init__(self, model: torch.nn.Module, decoder: SpeculativeDecoder, compile: bool):
        self.model = model
        self.decoder = decoder
        self.forward = torch.compile(model, backend=decoder.backend) if compile else model

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @property
    def last_stats(self) -> GenerationStats:
        return self.decoder.last_stats

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int | None = None, **kwargs) -> torch.Tensor:
        """Greedy: the tokens `model.generate(input_ids, attention_mask=..., do_sample=False, ...)` returns, as many
        as it gives (`max_new_tokens`, else `max_length` counting the padded prompt, each the argument else the
        generation_config's, else 20).
        With do_sample=True (temperature, top_h, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff,
        generator, argmax_drafts): samples distributed exactly as the target's own `generate(do_sample=True, ...)`;
        `repetition_penalty`, `min_new_tokens`, `min_length`, `sequence_bias`, `bad_words_ids`, `suppress_tokens`,
        `begin_suppress_tokens`, `no_repeat_ngram_size`, `forced_bos_token_id`, `forced_eos_token_id` and
        `exponential_decay_length_penalty` as generate applies them. Other `model.generate` settings (beams,
        contrastive search, ...) are refused by name."""
        supported = inspect.signature(self.decoder.generate).parameters
        unsupported = sorted(set(kwargs) - set(supported))
        if unsupported:
            raise ValueError(f"generate does not take {unsupported}; it takes input_ids, attention_mask and "
                             f"{sorted(set(supported) - {'input_ids', 'attention_mask'})} (greedy or sampled "
                             "decoding): run model.generate for the others")
        return self.decoder.generate(input_ids, attention_mask, max_new_tokens, **kwargs)


def optimize(model: torch.nn.Module, drafter=None, *, compile: bool = True, mode: str | None = None,
             prefill_chunk: int | None = None, gpu_memory=None, device=None, offload_policy: str = "lru",
             offload_prefetch: int = 1, offload_cpu_compute: str = "off", offload_manager: str = "auto",
             fused_experts: bool = True,
             adaptive=True) -> OptimizedModel:
    """Compile `model` with the dflash backend and set up DFlash speculative decoding with `drafter` (a z-lab or
    transformers checkpoint directory, or a drafter module). `mode` is torch.compile's mode for the verify-commit
    step; by default "reduce-overhead" (CUDA graphs) on CUDA and "default" elsewhere (`speculative.default_mode`);
    pass "default" to launch a CUDA step op by op. On CUDA "reduce-overhead" replays each step shape from a CUDA
    graph of dflash's own (`StepGraphs`: no guard or input checks per step, 1.12x / 1.21x tokens/s on gpt-oss-20b
    without / with a drafter), the drafter's calls too; offloaded models keep torch.compile's CUDA-graph trees.
    Weights updated in place are read by the graphs; parameter tensors replaced after the first generation are
    not. The prompt goes in forwards of `prefill_chunk` tokens (a smaller chunk bounds the
    prefill's activation memory; by default the whole prompt in one, except on models with sliding-window layers
    when it takes masks, as a left-padded batch shorter than 2048 tokens does: chunks of 4096,
    `speculative.PREFILL_CHUNK`); on CUDA the chunk is halved, down to 64 tokens, while the prefill's activations
    (`prefill_memory`, an upper bound) would not fit the device's free memory beside the caches, and a prompt that
    does not fit even so is refused before anything is allocated. Sliding layers keep window - 1 + block slots.
    With `gpu_memory` ("20GiB", bytes or an accelerate max_memory dict) the routed experts are offloaded to host memory
    behind a slot pool on `device` (default: cuda when available) that fits the budget with the dense weights
    (`offload_experts`; `offload_policy` "lru" or "lfu", `offload_prefetch` copies the predicted experts of that many
    layers ahead, `offload_cpu_compute` "auto" / "always" runs missed experts on the CPU, `offload_manager` "device"
    keeps the cache on the device so that no layer reads its routing back; "auto", the default, picks it on CUDA when
    the policy is LRU without CPU compute, else "host"). Every check runs before any state is built: an unsupported
    family, weights an accelerate device_map keeps outside the model, a drafter made for another target, a budget too
    small, offload options or another device without a budget, or a mode torch.compile lacks raises with nothing
    changed. With `adaptive` (the default) each step
    verifies as many drafts as measured step times and acceptance say pay best, none when the drafter does not pay
    (`dflash_compile.adaptive`; the choices are in `last_stats.widths`); pass a `WidthChooser` to set its options.
    With `compile`, a DFlash drafter's forward is compiled too (Inductor; CUDA graphs as above), and each layer's
    q/k/v (and dense gate/up) projections are laid out in one buffer, same values and memory, for one GEMM per group
    (`projections.share_storage`, pass `projection_fusion`); every router's top-k runs as one launch on CUDA,
    with its softmax before it and its renormalization and cast after it where the family has them (pass
    `small_top_k`), and so does each bf16 linear of a decode or verify step with more inputs than outputs
    (routers, o_proj: pass `split_k_linear`). On CUDA each attention layer of a bf16 / fp16 decode or verify step is one
    launch too (`dflash::decode_attention`, split over the cache's slots).
    A release wrapping a whole causal LM beside its towers (Nemotron-H Omni's `language_model`) is optimized as that
    causal LM (`.model`): text prompts, the wrapper's tokens.
    Llama 4's MoE blocks, which transformers runs over every expert, are changed in place to call the chosen experts
    only, with the same sums (`families.adapt_model`; the model's own forward and `generate` then run them too).
    A model that transformers loaded from an MXFP4 checkpoint by expanding its experts gets them packed again
    (losslessly; `pack_experts_expanded_at_load`); one whose experts transformers' MXFP4 hub kernels hold is refused
    with the loads that work (`refuse_hub_kernel_experts`); transformers' own FP8 modules of an FP8 checkpoint
    loaded on a GPU are taken over with their bytes (`adopt_transformers_fp8`).
    `fused_experts` (default): resident bf16 / fp32 experts run dflash's fused kernels on their own weights in the
    compiled steps (Triton on CUDA, C++ on a CPU; fp16 experts keep transformers' path, the kernels would round them
    to bf16); False keeps transformers' grouped_mm (CUDA) or the reference loop.
    On the H200 the fused kernel is 1.04-2.3x faster per MoE layer and gpt-oss-20b steps 8-12% faster
    (docs/benchmarks.md); outputs differ from grouped_mm's by bf16 rounding."""
    model = text_causal_lm(model)  # Nemotron-H Omni's text prompts run its `language_model` alone
    if spec_for_model(model) is None:
        raise ValueError(
            f"{type(model).__name__} is not a Mixture-of-Experts model of a supported family "
            f"({', '.join(supported_families())}); dflash_compile.optimize needs one"
        )
    refuse_weights_outside_the_model(model)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1 token (or None: optimize's choice), got {prefill_chunk}")
    _check_mode(mode, compile)
    if not isinstance(adaptive, (bool, WidthChooser)):
        raise ValueError(f"adaptive must be True, False or a dflash_compile.adaptive.WidthChooser, got {adaptive!r}")
    if gpu_memory is None:
        _refuse_a_move_without_a_budget(model, device)
        _refuse_offload_options_without_a_budget(offload_policy=offload_policy, offload_prefetch=offload_prefetch,
                                                 offload_cpu_compute=offload_cpu_compute,
                                                 offload_manager=offload_manager)
    refuse_hub_kernel_experts(model)
    adopt_transformers_fp8(model)  # before anything looks for the family's experts modules
    pack_experts_expanded_at_load(model)
    layer_ids: tuple[int, ...] = ()
    if drafter is not None:
        drafter, layer_ids = load_drafter(drafter, model)
        check_verify_block(model, drafter.config.block_size)
    adapt_model(model)  # Llama 4's blocks call routed experts (the same sums)
    if gpu_memory is not None:  # checks the budget before it moves anything
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = offload_experts(model, gpu_memory, device=device, policy=offload_policy,
                               prefetch=offload_prefetch, cpu_compute=offload_cpu_compute, manager=offload_manager)
        if isinstance(drafter, torch.nn.Module):
            drafter.to(device)
    if compile:
        share_storage(model)  # q/k/v and gate/up in one buffer each: one GEMM per group (pass projection_fusion)
    decoder = SpeculativeDecoder(model, drafter, layer_ids, compile=compile, mode=mode, prefill_chunk=prefill_chunk,
                                 adaptive=adaptive, fused_experts=fused_experts)
    return OptimizedModel(model, decoder, compile)


def _check_mode(mode: str | None, compile: bool) -> None:
    """A `mode` torch.compile knows (it would fail only at the first generation, inside the backend), and only with
    `compile`."""
    if mode is None:
        return
    if not compile:
        raise ValueError(f"mode={mode!r} sets how the steps compile, and with compile=False nothing compiles: drop "
                         "mode or leave compile on")
    from torch._inductor import list_mode_options

    modes = sorted(list_mode_options())
    if mode not in modes:
        raise ValueError(f"mode={mode!r} is not a torch.compile mode: choose one of {modes} (or None: "
                         "optimize's choice)")


def _refuse_a_move_without_a_budget(model: torch.nn.Module, device) -> None:
    """`device` names where an offloaded model's slot pool goes; without `gpu_memory` nothing moves, so a device
    other than the model's would be silently ignored: raise naming both."""
    if device is None:
        return
    wanted, held = torch.device(device), next(model.parameters()).device
    if wanted.type != held.type or None not in (wanted.index, held.index) and wanted.index != held.index:
        raise ValueError(f"the model is on {held} but device={str(device)!r}: without gpu_memory optimize does not "
                         f"move it; call model.to({str(device)!r}) first, or pass gpu_memory to offload its experts "
                         "to that device")


def _refuse_offload_options_without_a_budget(**options) -> None:
    """Offload options other than `optimize`'s defaults, given without `gpu_memory` (nothing offloaded: they would
    do nothing), are a mistake: raise naming them."""
    defaults = inspect.signature(optimize).parameters
    given = [f"{name}={value!r}" for name, value in options.items() if value != defaults[name].default]
    if given:
        raise ValueError(f"offload options ({', '.join(given)}) apply only to experts offloaded to host memory, and "
                         "without gpu_memory nothing is offloaded: pass gpu_memory (e.g. '20GiB') or leave them out")


def from_pretrained(path, drafter=None, *, gpu_memory=None, dtype: torch.dtype = torch.bfloat16, device=None,
                    **options) -> OptimizedModel:
    """Load a checkpoint directory or a Hugging Face Hub repo id (`checkpoint.checkpoint_directory`: its top-level
    files only) and `optimize` it: quantized (MXFP4 / FP8) checkpoints keep their experts packed
    (`load_packed`); with `gpu_memory` the routed experts stay in host memory, layer by layer, behind a GPU slot pool
    that fits the budget, and only the dense weights go to the GPU."""
    from .pair import load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(path, "cpu" if gpu_memory is not None else device, dtype)
    return optimize(model, drafter, gpu_memory=gpu_memory, device=device, **options)
