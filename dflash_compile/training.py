"""Training DFlash drafters for a target model (`train_drafter`), with the recipe of the DFlash paper:

- the target is frozen, and the drafter uses the target's own embedding and lm_head (frozen, never saved);
- the data is the target's own greedy continuations of prompts cut from the given texts, so the drafter learns to
  predict what the target will actually say;
- each training sequence carries several blocks at random anchor positions in the continuation, packed into one
  drafter forward with attention kept inside each block and to the context before its anchor
  (`DFlashDrafter.packed_logits`, the same computation as drafting at inference);
- cross-entropy on every masked block position, weighted exp(-(k - 1) / gamma) for position k = 1 .. B-1 so the
  early positions, which decide the accepted length, count most.

The result is a z-lab-format checkpoint that `optimize(model, drafter=path)` loads. Training state is written every
`checkpoint_every` steps under `out/training/` and picked up again when the same call is repeated; every step's
loss and per-position top-1 accuracy go to `out/training/log.jsonl`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .drafter import (
    DFlashDrafter, DrafterConfig, context_features, drafter_config, save_drafter, validate_pairing)
from .families import decoder_layers, head_dim


@dataclass(frozen=True)
class DrafterTraining:
    """Settings of `train_drafter`; the defaults suit tiny targets on a CPU or one GPU."""

    block_size: int = 16
    layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None  # default: up to 5 layers spread from the first to the last
    steps: int = 1000
    batch_size: int = 16
    prompt_length: int = 64
    continuation_length: int = 192
    blocks_per_sequence: int = 8
    sequences: int = 2048  # prompts continued by the target to make the training data
    generation_batch: int = 64  # prompts the target continues at once
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    gamma: float | None = None  # loss decay over block positions; default block_size / 2
    checkpoint_every: int = 200
    seed: int = 0

    def check(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if self.continuation_length < self.block_size:
            raise ValueError(f"continuation_length ({self.continuation_length}) must be at least block_size "
                             f"({self.block_size}): every block's labels come from the target's continuation")
        for name in ("layers", "steps", "batch_size", "prompt_length", "blocks_per_sequence", "sequences",
                     "generation_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _prompts(texts, tokenizer, length: int, count: int) -> torch.Tensor:
    """[n, length] prompts: consecutive windows of each text's ids, cycling over the texts until `count`."""
    windows = []
    for item in texts:
        ids = tokenizer(item)["input_ids"] if isinstance(item, str) else list(item)
        windows.extend(ids[start: start + length] for start in range(0, len(ids) - length + 1, length))
    if not windows:
        raise ValueError(f"no text has {length} tokens; give longer texts or a smaller prompt_length")
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(windows), generator=generator).tolist()
    return torch.tensor([windows[order[i % len(windows)]] for i in range(count)], dtype=torch.int64)


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int, batch_size: int = 64) -> torch.Tensor:
    """[n, prompt + new_tokens]: each prompt followed by the target's greedy continuation (not stopped at EOS,
    so every sequence has the same length)."""
    from transformers import GenerationConfig

    device = target.get_input_embeddings().weight.device
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0)
    chunks = [target.generate(chunk.to(device), generation_config=config).cpu()
              for chunk in tqdm(prompts.split(batch_size), desc="target continuations", leave=False)]
    return torch.cat(chunks)


def _default_layer_ids(num_layers: int) -> tuple[int, ...]:
    count = min(num_layers, 5)
    return tuple(round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count))


def _features(target, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states at the drafter's layers, concatenated: what inference feeds the drafter."""
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True, use_cache=False).hidden_states
    return context_features(hidden, layer_ids, target.config.get_text_config().hidden_size)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-weighted cross-entropy over [b, n, B-1, V] logits, and the top-1 accuracy per block position."""
    positions = logits.shape[2]
    weights = torch.exp(-torch.arange(positions, device=logits.device, dtype=torch.float32) / gamma)
    losses = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def cosine_learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to zero at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _new_drafter(target, settings: DrafterTraining, mask_token_id: int) -> tuple[dict, DFlashDrafter]:
    text = target.config.get_text_config()
    layer_ids = settings.target_layer_ids or _default_layer_ids(decoder_layers(text))
    raw = drafter_config(
        target.config, block_size=settings.block_size, mask_token_id=mask_token_id, target_layer_ids=layer_ids,
        layer_types=("full_attention",) * settings.layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", text.num_attention_heads),
        head_dim=head_dim(text),
        rope_theta=(getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    config = DrafterConfig.from_dict(raw)
    validate_pairing(config, (text.hidden_size, len(layer_ids) * text.hidden_size), target.config)
    torch.manual_seed(settings.seed)
    return raw, DFlashDrafter(config, len(layer_ids))


def train_drafter(target, texts, out: str | Path, tokenizer=None, settings: DrafterTraining | None = None,
                  mask_token_id: int | None = None, device=None, save_dtype: torch.dtype = torch.float32,
                  progress: bool = True) -> Path:
    """Train a DFlash drafter for `target` on its own greedy continuations of `texts` (strings, with
    `tokenizer`, or lists of token ids) and write it to `out` as a z-lab-format checkpoint; returns `out`.

    `mask_token_id` defaults to the tokenizer's mask token. Interrupted runs resume from `out/training/`.
    """
    settings = settings or DrafterTraining()
    settings.check()
    if mask_token_id is None:
        mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if mask_token_id is None:
            raise ValueError("train_drafter needs a mask token: pass mask_token_id=, or a tokenizer with a "
                             "mask_token (the drafter fills the block's unknown positions with it)")
    if any(isinstance(t, str) for t in texts) and tokenizer is None:
        raise ValueError("texts are strings: pass the target's tokenizer to train_drafter")
    out = Path(out)
    device = torch.device(device or target.get_input_embeddings().weight.device)
    target = target.to(device).eval().requires_grad_(False)
    raw, drafter = _new_drafter(target, settings, mask_token_id)
    drafter.to(device).train()
    layer_ids = tuple(raw["dflash_config"]["target_layer_ids"])
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.learning_rate, weight_decay=0.01)

    state_dir = out / "training"
    state_dir.mkdir(parents=True, exist_ok=True)
    data_file, state_file, log_file = state_dir / "data.pt", state_dir / "state.pt", state_dir / "log.jsonl"
    if data_file.is_file():
        sequences = torch.load(data_file)
    else:
        prompts = _prompts(texts, tokenizer, settings.prompt_length, settings.sequences)
        sequences = greedy_continuations(target, prompts, settings.continuation_length,
                                         settings.generation_batch)
        torch.save(sequences, data_file)
    start = 0
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    records = log_file.read_text().splitlines() if log_file.is_file() else []
    log_file.write_text("".join(line + "\n" for line in records if json.loads(line)["step"] < start))

    generator = torch.Generator().manual_seed(settings.seed + start)
    gamma = settings.gamma or settings.block_size / 2
    first, last = settings.prompt_length, sequences.shape[1] - settings.block_size  # anchors in the continuation
    bar = tqdm(range(start, settings.steps), desc="drafter", disable=not progress, initial=start,
               total=settings.steps)
    for step in bar:
        rows = torch.randint(0, len(sequences), (settings.batch_size,), generator=generator)
        tokens = sequences[rows].to(device)
        spread = torch.rand(settings.batch_size, last - first + 1, generator=generator)
        anchors = spread.argsort(dim=1)[:, : settings.blocks_per_sequence].sort(dim=1).values.to(device) + first
        labels = tokens.gather(1, (anchors[:, :, None] + torch.arange(1, settings.block_size, device=device))
                               .flatten(1)).view(*anchors.shape, -1)
        logits = drafter.packed_logits(_features(target, tokens, layer_ids), tokens, anchors, embed, lm_head)
        loss, accuracy = block_loss(logits, labels, gamma)
        for group in optimizer.param_groups:
            group["lr"] = cosine_learning_rate(step, settings.steps, settings.learning_rate, settings.warmup_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        record = {"step": step, "loss": loss.item(), "accuracy": [round(a, 4) for a in accuracy.tolist()]}
        with log_file.open("a") as log:
            log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{record['loss']:.3f}", first_token_acc=f"{record['accuracy'][0]:.2f}")
        if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
            torch.save({"drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "loss": loss.item()}, state_file)
    weights = {k: v.detach().to(save_dtype) for k, v in drafter.state_dict().items()}
    return save_drafter(out, raw, weights)
