"""Sampling settings, applied to target and draft logits alike, in transformers' generate order
(temperature, top-h, top-k, top-p, min-p, typical-p, epsilon cutoff, eta cutoff), using transformers' own logits
warpers (top-p's probabilities read from a sort before its scan, `TopPWarper`; typical-p's scan an op of its own,
`TypicalWarper`; top-h's and eta's entropies without a torch.distributions object, `_categorical`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList, MinPLogitsWarper, NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    TypicalLogitsWarper)

from .ops import ordered_cumsum


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject settings generate would reject, before any state changes."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 with do_sample=True, got {temperature}; use do_sample=False for "
                         "greedy decoding")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


# generation_config fields with which transformers' generate outputs something else than greedy decoding or sampling
# with temperature / top-h / top-k / top-p / min-p / typical-p / epsilon / eta cutoffs, a repetition penalty, a
# minimum length, forced BOS / EOS tokens, an exponentially decaying length penalty, sequence biases (banned tokens
# and words among them) and banned repeated n-grams, which
# dflash_compile's generate implements: other logits processors, other decoding modes, more sequences per prompt. A
# model whose generation_config sets one (to anything but transformers' default or a no-op, _NO_OPS) would decode
# differently from model.generate.
_APPLIED = ("watermarking_config", "guidance_scale", "num_beams", "num_beam_groups", "diversity_penalty",
            "penalty_alpha", "constraints", "force_words_ids", "dola_layers", "num_return_sequences")
_NO_OPS = {"guidance_scale": 1.0, "penalty_alpha": 0.0}


def check_generation_config(config) -> None:
    """Refuse, before any state changes, a generation_config that makes transformers' generate do what this one does
    not (`_APPLIED`), naming the fields and how to go without them."""
    defaults = config._get_default_generation_params()  # transformers' own defaults, e.g. repetition_penalty 1.0
    applied = [f"{name}={value!r}" for name in _APPLIED if (value := getattr(config, name, None)) is not None
               and value != defaults.get(name) and value != _NO_OPS.get(name)]
    if applied:
        raise ValueError(f"the model's generation_config sets {', '.join(applied)}, which transformers' generate "
                         "applies and dflash_compile's does not (it decodes greedily or samples with temperature, "
                         "top_h, top_k, top_p, min_p, typical_p, epsilon_cutoff and eta_cutoff, with "
                         "repetition_penalty, min_new_tokens / min_length, forced_bos_token_id, forced_eos_token_id, "
                         "exponential_decay_length_penalty, sequence_bias, bad_words_ids, suppress_tokens and "
                         "no_repeat_ngram_size): set them to None on model.generation_config to generate without "
                         "them, or run model.generate")


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


def _categorical(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (log-probabilities, probabilities, [...] entropies), as
    torch.distributions.Categorical(logits=scores) computes them (for the entropy a filtered token's -inf
    log-probability clamped to the dtype's lowest before its zero weight), without the distribution object, whose
    argument checks Dynamo would trace into the compiled step."""
    normalized = scores - scores.logsumexp(dim=-1, keepdim=True)
    probs = normalized.softmax(dim=-1)
    return normalized, probs, -(normalized.clamp(min=torch.finfo(normalized.dtype).min) * probs).sum(-1)


class TopHWarper(TopHLogitsWarper):
    """transformers' top-h filter with `_categorical` for its torch.distributions object: the same tokens kept."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        top_logits, top_index = torch.topk(scores, min(self.top_n, scores.shape[-1]), dim=-1, sorted=True)
        _, probs, entropy = _categorical(top_logits)
        keep = (-probs * torch.log(probs)).cumsum(dim=-1) <= entropy[..., None] * self.top_h
        keep[..., 0] = True  # the likeliest token, whatever the threshold
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top_index, keep)
        return scores.masked_fill(~kept, self.filter_value)


class TypicalWarper(TypicalLogitsWarper):
    """transformers' typical-p filter with the probabilities its scan adds up taken from one softmax over the
    vocabulary, gathered into the typical order inside `ops.ordered_cumsum` (opaque to Inductor), instead of a
    softmax taken after the typical sort: the softmax's per-row max and sum then stay out of the vocabulary-long
    scan, which torch 2.11's Inductor fails to generate on CUDA (see `TopPWarper`), and so does the gather (a gather
    fused into that scan fails as well, seen on an H100). The same tokens kept, up to the last bit of a sum."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        normalized = torch.nn.functional.log_softmax(scores, dim=-1)
        probs = torch.exp(normalized)
        entropy = -(normalized * probs).nansum(-1, keepdim=True)
        shifted, order = torch.sort(torch.abs(-normalized - entropy))  # the most typical tokens first
        cumulative = ordered_cumsum(probs, order)
        last = (cumulative < self.mass).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
        remove = shifted > shifted.gather(-1, last)
        remove[..., :self.min_tokens_to_keep] = False
        return scores.masked_fill(remove.scatter(-1, order, remove), self.filter_value)


class EtaWarper(EtaLogitsWarper):
    """transformers' eta filter with `_categorical` for its torch.distributions object, and its epsilon (fp32, as
    transformers keeps it) and that epsilon's fp32 square root as numbers: the same cutoff on any device."""

    def __init__(self, epsilon: float, min_tokens_to_keep: int = 1):
        super().__init__(epsilon, min_tokens_to_keep=min_tokens_to_keep)
        self.cutoff, self.root = float(self.epsilon), float(self.epsilon.sqrt())

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        eta = (self.root * torch.exp(-_categorical(scores)[2])).clamp(max=self.cutoff)[..., None]
        remove = scores.softmax(dim=-1) < eta
        # the likeliest min_tokens_to_keep tokens stay, whatever the cutoff
        remove &= scores < torch.topk(scores, min(self.min_tokens_to_keep, scores.shape[-1]))[0][..., -1, None]
        return scores.masked_fill(remove, self.filter_value)


def warpers(temperature: float | None = 1.0, top_k: int | None = None, top_p: float | None = None,
            min_p: float | None = None, epsilon_cutoff: float | None = None, top_h: float | None = None,
            typical_p: float | None = None, eta_cutoff: float | None = None) -> LogitsProcessorList:
    """The warper chain generate builds for these settings (None: not applied), in its order and on its conditions;
    transformers' warpers refuse what generate's would (min_p outside [0, 1], ...)."""
    temperature = 1.0 if temperature is None else temperature
    check_sampling(temperature, top_k, top_p)
    chain = LogitsProcessorList()
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_h is not None:
        chain.append(TopHWarper(top_h))
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPWarper(top_p))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p))
    if typical_p is not None and typical_p < 1.0:
        chain.append(TypicalWarper(typical_p))
    if epsilon_cutoff is not None and epsilon_cutoff != 0.0:  # its default; the warper refuses values outside (0, 1)
        chain.append(EpsilonLogitsWarper(epsilon_cutoff))
    if eta_cutoff is not None and eta_cutoff != 0.0:  # likewise
        chain.append(EtaWarper(eta_cutoff))
    return chain


def check_repetition_penalty(penalty) -> None:
    if not isinstance(penalty, float) or not penalty > 0:
        raise ValueError(f"repetition_penalty must be a positive float (1.0: none), got {penalty!r}")


def seen_tokens(ids: torch.Tensor, pad: torch.Tensor, vocab: int, out: torch.Tensor) -> torch.Tensor:
    """`out` [b, vocab + 1] bool: which tokens each row's prompt `ids` [b, P] holds after its `pad` left padding (the
    last column collects what is not counted), as transformers' repetition penalty counts a prompt."""
    padding = torch.arange(ids.shape[1], device=ids.device)[None, :] < pad[:, None]
    return out.zero_().scatter_(1, ids.masked_fill(padding, vocab), True)


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, block: torch.Tensor | None,
                         penalty: float) -> torch.Tensor:
    """Logits [b, w, V] over a verify `block` [b, w] (None: [b, ..., V] after the row's earlier tokens alone) with
    transformers' repetition penalty (RepetitionPenaltyLogitsProcessor), in fp32 as generate applies it: at position j
    each token that the row's earlier tokens (`seen` [b, V + 1], see `seen_tokens`) or block[:, :j + 1] hold, once
    however often, has its logit divided by `penalty` where positive and multiplied where negative."""
    vocab = logits.shape[-1]
    present = seen[:, :vocab].view(seen.shape[0], *[1] * (logits.ndim - 2), vocab)
    if block is not None:
        width = torch.arange(block.shape[1], device=block.device)
        upto = torch.where(width[None, :, None] >= width[None, None, :], block[:, None, :], vocab)  # [b, j, i]
        present = seen[:, None, :].expand(-1, block.shape[1], -1).scatter(2, upto, True)[..., :vocab]
    scores = logits.float()
    return torch.where(present, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


@dataclass(frozen=True)
class SequenceBiases:
    """generate's sequence biases (SequenceBiasLogitsProcessor: `sequence_bias`; NoBadWordsLogitsProcessor:
    `bad_words_ids` at -inf, an EOS bad word kept; SuppressTokensLogitsProcessor: `suppress_tokens` at -inf),
    validated by those processors: `tokens` [V] the one-token biases; the longer sequences' `prefixes` [S, K], their
    tokens but the last, right-aligned after -1 (any token), `last` [S] their last tokens and `values` [S] fp32."""

    tokens: torch.Tensor
    prefixes: torch.Tensor
    last: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, vocabulary: int, sequence_bias, bad_words_ids, suppress_tokens, eos: set[int]) -> SequenceBiases | None:
        """None where generate would add none of the three processors."""
        sources = [SequenceBiasLogitsProcessor(sequence_bias).sequence_bias if sequence_bias else {},
                   NoBadWordsLogitsProcessor(bad_words_ids, list(eos) or None).sequence_bias if bad_words_ids else {}]
        outside = sorted({t for source in sources for sequence in source for t in sequence if not 0 <= t < vocabulary})
        if outside:  # generate raises at its first step
            raise ValueError(f"token ids {outside} of sequence_bias / bad_words_ids are outside the model's vocabulary "
                             f"of {vocabulary}")
        suppressed = SuppressTokensLogitsProcessor(suppress_tokens).suppress_tokens.tolist() if suppress_tokens else []
        sources.append({(t,): float("-inf") for t in suppressed if 0 <= t < vocabulary})  # others: never drawn anyway
        biases: dict[tuple[int, ...], float] = {}
        for source in sources:  # each processor adds its bias: -inf wins over any other
            for sequence, value in source.items():
                biases[tuple(sequence)] = biases.get(tuple(sequence), 0.0) + value
        if not biases:
            return None
        tokens = torch.zeros(vocabulary)
        longer = {sequence: value for sequence, value in biases.items() if len(sequence) > 1}
        for sequence, value in biases.items():
            if len(sequence) == 1:
                tokens[sequence[0]] = value
        width = max((len(sequence) - 1 for sequence in longer), default=1)
        prefixes = torch.tensor([[-1] * (width + 1 - len(sequence)) + list(sequence[:-1]) for sequence in longer]
                                or [[-1] * width], dtype=torch.int64)
        last = torch.tensor([sequence[-1] for sequence in longer] or [0], dtype=torch.int64)
        values = torch.tensor(list(longer.values()) or [0.0], dtype=torch.float32)
        return cls(tokens, prefixes, last, values)


def begin_suppressed(tokens) -> list[int]:
    """generate's `begin_suppress_tokens` (SuppressTokensAtBeginLogitsProcessor): ids banned at the first new token."""
    return SuppressTokensAtBeginLogitsProcessor(tokens, 0).begin_suppress_tokens.tolist() if tokens else []


def _with_block(history: torch.Tensor, lengths: torch.Tensor, block: torch.Tensor | None, width: int):
    """(each row's sequence [b, C]: its `history` with `block` [b, w] written after its `lengths` [b]; the sequence's
    length before each of the w positions' next token [b, w]). With `block` None: the history alone, `width` 1."""
    ends = lengths[:, None] + torch.arange(width, device=lengths.device)[None, :]
    if block is None:
        return history, ends
    return history.scatter(1, ends, block), ends + 1


def _last_tokens(sequence: torch.Tensor, ends: torch.Tensor, count: int) -> torch.Tensor:
    """[b, w, count]: the `count` tokens of `sequence` [b, C] before each of `ends` [b, w] (clamped at its start)."""
    offsets = torch.arange(-count, 0, device=ends.device)
    b, w = ends.shape
    return sequence.gather(1, (ends[:, :, None] + offsets).clamp(min=0).view(b, -1)).view(b, w, count)


def sequence_biased(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, block: torch.Tensor | None,
                    biases: SequenceBiases) -> torch.Tensor:
    """fp32 logits [b, w, V] with `biases` added at each position j as generate adds them: the one-token ones, and
    a longer sequence's at its last token where the row's sequence so far (`_with_block`) ends with its prefix."""
    sequence, ends = _with_block(history, lengths, block, logits.shape[1])
    recent = _last_tokens(sequence, ends, biases.prefixes.shape[1])  # [b, w, K]
    anything = biases.prefixes < 0
    fits = ends[:, :, None] >= (~anything).sum(dim=-1)  # a prefix longer than the sequence never matches
    matches = ((recent[:, :, None, :] == biases.prefixes) | anything).all(dim=-1) & fits  # [b, w, S]
    added = torch.where(matches, biases.values, 0.0)
    bias = biases.tokens.expand(*logits.shape).clone().index_add_(2, biases.last, added)
    return logits.float() + bias


def check_ngram_size(size) -> int:
    """`no_repeat_ngram_size` as generate takes it: 0 or None for none, else refused unless a positive int."""
    if not size:
        return 0
    return NoRepeatNGramLogitsProcessor(size).ngram_size  # transformers' own check


def repeated_ngrams_banned(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor,
                           block: torch.Tensor | None, size: int) -> torch.Tensor:
    """Logits [b, w, V] with transformers' no_repeat_ngram_size (NoRepeatNGramLogitsProcessor): at position j a
    token is -inf where it would complete an n-gram (n = `size`) that the row's sequence already holds -- its
    `history` [b, C] up to `lengths` [b] (the left-padded prompt as given and the tokens since, as generate's
    input_ids hold them) followed by block[:, :j + 1]; or (`block` None) the history alone, one position."""
    b, w, vocab = logits.shape
    sequence, ends = _with_block(history, lengths, block, w)
    windows = sequence.unfold(1, size, 1)  # [b, C - size + 1, size]
    prefix = _last_tokens(sequence, ends, size - 1)
    starts = torch.arange(windows.shape[1], device=lengths.device)
    matches = (windows[:, None, :, :-1] == prefix[:, :, None, :]).all(dim=-1) & (starts <= ends[:, :, None] - size)
    following = torch.where(matches, windows[:, None, :, -1].clamp(max=vocab), vocab)  # past the vocabulary: none
    banned = torch.zeros(b, w, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(2, following, True)
    return logits.masked_fill(banned[..., :vocab], float("-inf"))


@dataclass(frozen=True)
class LengthProcessors:
    """A generate call's processors that depend on how many tokens each row has made (part of a compiled step's
    key; their counts live in `TargetCache.countdowns`): a minimum length holding EOS back, a forced EOS as the last
    token, an exponentially decaying length penalty's factor (None: none), and a forced BOS id as the first token
    (None: none; generate forces it after a one-token prompt only)."""

    holds_eos: bool = False
    forces_eos: bool = False
    decay: float | None = None
    forced_bos: int | None = None

    @property
    def count(self) -> bool:
        """Whether the steps count down `TargetCache.countdowns`."""
        return self.holds_eos or self.forces_eos or self.decay is not None


# the columns of `TargetCache.countdowns`: new tokens before a row's EOS may come (`eos_held_back`), to its forced
# EOS (`forced`), and to where its EOS logit starts to grow (`eos_decayed`); each verified position j is that many
# tokens further
COUNTDOWNS = HOLD, FORCE, DECAY = range(3)


def eos_held_back(logits: torch.Tensor, waits: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Logits [b, w, V] of a verify block with transformers' minimum length (MinNewTokensLengthLogitsProcessor,
    MinLengthLogitsProcessor): a row that must still make `waits` [b] new tokens before its EOS gets -inf at its EOS
    ids (`eos` [V] bool) at positions j < waits."""
    early = torch.arange(logits.shape[1], device=logits.device)[None, :] < waits[:, None]
    return logits.masked_fill(early[..., None] & eos, float("-inf"))


def forced(logits: torch.Tensor, at: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [b, w, V] with transformers' ForcedEOSTokenLogitsProcessor (or its BOS one): at position j == at[b] (a
    row's last new token) -inf everywhere but 0 at the `allowed` [V] ids."""
    now = torch.arange(logits.shape[1], device=logits.device)[None, :] == at[:, None]
    only = torch.zeros_like(allowed, dtype=logits.dtype).masked_fill(~allowed, float("-inf"))
    return torch.where(now[..., None], only, logits)


def eos_decayed(logits: torch.Tensor, start: torch.Tensor, eos: torch.Tensor, factor: float) -> torch.Tensor:
    """Logits [b, w, V] in fp32 with transformers' ExponentialDecayLengthPenalty: at position j, i = j - start[b]
    tokens past the row's regulation start, each finite EOS logit x gets |x| * (factor^i - 1) added where i > 0 (the
    multiplier in double, then fp32, as generate's Python float)."""
    past = (torch.arange(logits.shape[1], device=logits.device)[None, :] - start[:, None]).clamp(min=0)
    multiplier = (torch.full_like(past, factor, dtype=torch.float64) ** past - 1).float()
    scores = logits.float()
    penalty = (scores.abs() * multiplier[..., None]).masked_fill(~(eos & scores.isfinite()), 0.0)
    return scores + penalty


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
