"""Sampling settings, applied to target and draft logits alike, in transformers' generate order
(temperature, then top-k, then top-p), using transformers' own logits warpers (top-p's softmax taken before its sort,
`TopPWarper`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject settings generate would reject, before any state changes."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 with do_sample=True, got {temperature}; use do_sample=False for "
                         "greedy decoding")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class TopPWarper(TopPLogitsWarper):
    """transformers' top-p filter with its softmax taken before the sort instead of after: the same tokens kept (the
    softmax keeps their order), and the cumulative sum then reads the sort's output alone. torch 2.11's Inductor
    fails to generate the split scan it picks for a vocabulary-long cumsum into which the softmax's per-row max and
    sum are fused (pytorch/pytorch#180221, fixed by #180369 in later releases): every sampled verify step at a real
    vocabulary did."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        ascending, order = torch.sort(scores.softmax(dim=-1))
        remove = ascending.cumsum(dim=-1) <= 1 - self.top_p
        remove[..., -self.min_tokens_to_keep:] = False
        return scores.masked_fill(remove.scatter(1, order, remove), self.filter_value)


def warpers(temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None):
    """The warper chain generate builds for these settings (None: not applied)."""
    temperature = 1.0 if temperature is None else temperature
    check_sampling(temperature, top_k, top_p)
    chain = LogitsProcessorList()
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPWarper(top_p))
    return chain


def processed_probs(logits: torch.Tensor, chain: LogitsProcessorList) -> torch.Tensor:
    """[..., V] logits -> the probabilities generate would sample from under `chain`."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))  # at least fp32; fp64 stays fp64
    return torch.softmax(chain(None, flat), dim=-1).view(logits.shape)


@dataclass
class Sampler:
    """How one sampled `generate` call draws: the warpers, the random generator, and whether drafts are argmax
    (judged by the one-hot rule) or drawn from the drafter's processed distribution q."""

    chain: LogitsProcessorList
    generator: torch.Generator | None = None
    argmax_drafts: bool = False

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per distribution: [..., V] -> [...]."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])

    def uniforms(self, shape, device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device)
