"""The bundled default model pair: a tiny Qwen3-MoE target trained on the Python standard library's sources and its
DFlash drafter, made by `scripts/tiny_pair.py` (see docs/default_pair.md). It is what `dflash-compile generate`
runs when no model is named, and what the tests use to check a trained drafter end to end.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

DEFAULT_PAIR = Path(__file__).parent / "default_pair"


def pair_paths(directory: str | Path | None = None) -> tuple[Path, Path]:
    """(target dir, drafter dir) of a pair directory, the bundled one by default."""
    root = Path(directory) if directory is not None else DEFAULT_PAIR
    target, drafter = root / "target", root / "drafter"
    for path in (target, drafter):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: {root} is not a model pair "
                                    "(make one with scripts/tiny_pair.py)")
    return target, drafter


def heldout_prompts(directory: str | Path | None = None) -> list[str]:
    """Prompts from standard-library files that neither model saw in training."""
    root = Path(directory) if directory is not None else DEFAULT_PAIR
    return json.loads((root / "heldout_prompts.json").read_text())


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """A causal LM (an image-text-to-text model where the family has no causal LM, `auto_model_class`) from a
    checkpoint directory or a Hub repo id (`checkpoint_directory`); MXFP4 and FP8 block-scaled checkpoints load with
    their experts packed (`load_packed`)."""
    import transformers

    from .checkpoint import checkpoint_directory, load_packed
    from .families import auto_model_class

    path = checkpoint_directory(path)
    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None):
        return load_packed(path, dtype, device)
    return auto_model_class(config).from_pretrained(path, dtype=dtype).to(device).eval()


def load_target(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a checkpoint directory or a Hub repo id, the tokenizer padding on the left as batched
    decoding needs. The tokenizer loads first: a checkpoint without one is refused before its weights are read."""
    from .checkpoint import checkpoint_directory

    path = checkpoint_directory(path)
    tokenizer = load_tokenizer(path)
    return load_model(path, device, dtype), tokenizer


def load_tokenizer(path: str | Path):
    """The checkpoint directory's tokenizer, padding on the left; a clear error where it has none."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise ValueError(f"{path} has no tokenizer transformers can load ({first_line}); the prompts are text: save "
                         "the model's tokenizer beside its weights (tokenizer.save_pretrained)") from error


def acceptance_on_prompts(directory: str | Path | None, prompts: list[str], device="cpu",
                          max_new_tokens: int = 128, compile: bool = False) -> dict:
    """Greedy speculative generation of every prompt alone: mean accepted length (tau) over all verify steps, and
    whether each output equals the target's own `generate(do_sample=False)`. Timings are of the last prompt."""
    from .api import optimize

    target_dir, drafter_dir = pair_paths(directory)
    model, tokenizer = load_target(target_dir, device)
    fast = optimize(model, drafter=drafter_dir, compile=compile, adaptive=False)  # the drafter's block, every step
    committed, steps, identical = 0, 0, []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        ours = fast.generate(ids, max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        reference = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        reference_seconds = time.perf_counter() - start
        identical.append(bool(torch.equal(ours, reference)))
        stats = fast.last_stats
        committed += sum(a + 1 for step in stats.accepted for a in step if a is not None)
        steps += stats.steps
    return {"prompts": len(prompts), "block_size": fast.decoder.block_size, "max_new_tokens": max_new_tokens,
            "tau": committed / steps, "identical": sum(identical), "device": str(device),
            "last_prompt_tokens_per_second": {"dflash": fast.last_stats.tokens_per_second,
                                              "transformers_generate": max_new_tokens / reference_seconds}}
