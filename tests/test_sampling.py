"""Lossless sampled acceptance: exact integration over drafts and uniforms of dflash::sampled_accept."""

import itertools

import pytest
import torch

from transformers.generation.logits_process import (
    EtaLogitsWarper, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    TypicalLogitsWarper)

from dflash_compile.sampling import (EtaWarper, SequenceBiases, TopHWarper, TopPWarper, TypicalWarper, check_sampling,
                                     processed_probs, repeated_ngrams_banned, repetition_penalized, seen_tokens,
                                     sequence_biased, warpers)

VOCAB, BLOCK = 4, 3  # two drafts and the bonus position


def bisect(predicate, lo=0.0, hi=1.0, steps=60):
    """sup{u in [lo, hi]: predicate(u)} for a predicate true below a threshold and false above."""
    if not predicate(lo):
        return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicate(mid) else (lo, mid)
    return lo


def run(block, target, draft, uniforms, one_hot):
    accepted, tokens = torch.ops.dflash.sampled_accept(
        torch.tensor([block]), target[None], draft[None], torch.tensor([uniforms], dtype=torch.float64), one_hot)
    return int(accepted), tokens[0].tolist()


def outcome_measure(block, target, draft, one_hot):
    """{committed tokens: probability} over the uniforms, integrated exactly: each accept test is a threshold in
    its own uniform (found by bisection on the op), and the final token is a monotone step function of the last
    uniform (its steps found by bisection too)."""
    measure = {}
    drafts = BLOCK - 1

    def final_tokens(us, weight, accepted):
        # F(v) = token sampled at position `accepted`; nondecreasing in v
        def token_at(v):
            return run(block, target, draft, [*us, v], one_hot)[1][accepted]

        starts = [0.0] + [bisect(lambda v, j=j: token_at(v) < j) for j in range(1, VOCAB)] + [1.0]
        for j in range(VOCAB):
            mass = max(starts[j + 1] - starts[j], 0.0)
            if mass > 0:
                key = tuple(block[1: accepted + 1]) + (j,)
                measure[key] = measure.get(key, 0.0) + weight * mass

    def descend(us, weight):
        i = len(us)
        if i == drafts:  # every draft passed
            return final_tokens(us, weight, drafts)
        threshold = bisect(lambda u: run(block, target, draft, [*us, u, *[0.0] * (BLOCK - i - 1)], one_hot)[0] > i)
        if threshold > 0:
            descend([*us, threshold / 2], weight * threshold)
        if threshold < 1:
            final_tokens([*us, (1 + threshold) / 2, *[0.0] * (drafts - i - 1)], weight * (1 - threshold), i)

    descend([], 1.0)
    return measure


def distributions(seed, settings):
    """A target and a draft model over prefixes of length < BLOCK: processed probabilities per prefix."""
    generator = torch.Generator().manual_seed(seed)
    chain = warpers(**settings)
    prefixes = [p for n in range(BLOCK) for p in itertools.product(range(VOCAB), repeat=n)]
    target = {p: processed_probs(torch.randn(VOCAB, generator=generator, dtype=torch.float64) * 2, chain)
              for p in prefixes}
    draft = {p: processed_probs(torch.randn(VOCAB, generator=generator, dtype=torch.float64) * 2, chain)
             for p in prefixes}
    return target, draft


def max_deviation(settings, one_hot, rule_one_hot=None):
    """Largest gap between the exact distribution of each committed token (given the ones before it) and the
    target's. `rule_one_hot` lets a test run the op with the wrong rule for how the drafts were made."""
    rule_one_hot = one_hot if rule_one_hot is None else rule_one_hot
    target, draft = distributions(0, settings)
    joint = {}
    sequences = ([_argmax_path(draft)] if one_hot else itertools.product(range(VOCAB), repeat=BLOCK - 1))
    for drafts in sequences:
        q = 1.0 if one_hot else float(draft[()][drafts[0]] * draft[drafts[:1]][drafts[1]])
        if q == 0:
            continue
        block = [0, *drafts]
        target_probs = torch.stack([target[()], target[drafts[:1]], target[drafts]])
        draft_probs = torch.stack([draft[()], draft[drafts[:1]]])
        for tokens, mass in outcome_measure(block, target_probs, draft_probs, rule_one_hot).items():
            joint[tokens] = joint.get(tokens, 0.0) + q * mass
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-9)
    deviation = 0.0
    # token k of a step, given the k - 1 before it were committed, must follow the target given them
    for k in range(1, BLOCK + 1):
        for prefix in itertools.product(range(VOCAB), repeat=k - 1):
            mass = [sum(m for t, m in joint.items() if len(t) >= k and t[: k - 1] == prefix and t[k - 1] == j)
                    for j in range(VOCAB)]
            if sum(mass) > 1e-12:
                deviation = max(deviation, max(abs(m / sum(mass) - float(target[prefix][j]))
                                               for j, m in enumerate(mass)))
    return deviation


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-drafts", "argmax-drafts"])
@pytest.mark.parametrize(
    "settings",
    [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=3), dict(temperature=0.9, top_p=0.8),
     dict(top_k=2, top_p=0.9), dict(temperature=1.3, min_p=0.3), dict(epsilon_cutoff=0.2),
     dict(temperature=0.8, typical_p=0.6), dict(eta_cutoff=0.3), dict(top_h=0.6)],
)
def test_committed_tokens_follow_the_target_exactly(settings, one_hot):
    assert max_deviation(settings, one_hot) <= 1e-6


def test_the_check_catches_a_wrong_rule():
    """Argmax drafts judged as if they had been sampled from q (min(1, p/q), residual max(p - q, 0)) are biased,
    and the check says so. (The converse, the one-hot rule on sampled drafts, is lossless, only less efficient.)"""
    assert max_deviation(dict(temperature=0.7), one_hot=True, rule_one_hot=False) > 1e-2


def _argmax_path(draft):
    first = int(draft[()].argmax())
    return first, int(draft[(first,)].argmax())


def test_opcheck_ordered_cumsum():
    values = torch.randn(2, 3, 7)
    order = torch.stack([torch.randperm(7) for _ in range(6)]).reshape(2, 3, 7)
    torch.library.opcheck(torch.ops.dflash.ordered_cumsum.default, (values, order))
    assert torch.equal(torch.ops.dflash.ordered_cumsum(values, order), values.gather(-1, order).cumsum(-1))


def test_opcheck_sampled_accept():
    block = torch.tensor([[0, 1, 2], [3, 0, 0]])
    target = torch.softmax(torch.randn(2, 3, 5), -1)
    draft = torch.softmax(torch.randn(2, 2, 5), -1)
    uniforms = torch.rand(2, 3)
    for one_hot in (False, True):
        torch.library.opcheck(torch.ops.dflash.sampled_accept.default, (block, target, draft, uniforms, one_hot))
    # a block of one token (no drafter): the token is sampled from p
    accepted, tokens = torch.ops.dflash.sampled_accept(block[:, :1], target[:, :1], draft[:, :0], uniforms[:, :1], True)
    assert accepted.tolist() == [0, 0] and tokens.shape == (2, 1)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(temperature=0.0), r"temperature must be > 0 with do_sample=True, got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_bad_sampling_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(**{"temperature": 1.0, "top_k": None, "top_p": None, **settings})


@pytest.mark.parametrize("ours, theirs, settings", [
    (TopPWarper, TopPLogitsWarper, dict(top_p=0.9)), (TopPWarper, TopPLogitsWarper, dict(top_p=0.5)),
    (TopPWarper, TopPLogitsWarper, dict(top_p=0.05, min_tokens_to_keep=3)),
    (TypicalWarper, TypicalLogitsWarper, dict(mass=0.9)), (TypicalWarper, TypicalLogitsWarper, dict(mass=0.2)),
    (TypicalWarper, TypicalLogitsWarper, dict(mass=0.01, min_tokens_to_keep=3)),
    (EtaWarper, EtaLogitsWarper, dict(epsilon=3e-4)), (EtaWarper, EtaLogitsWarper, dict(epsilon=0.05)),
    (EtaWarper, EtaLogitsWarper, dict(epsilon=0.9, min_tokens_to_keep=3)),
    (TopHWarper, TopHLogitsWarper, dict(top_h=0.4)), (TopHWarper, TopHLogitsWarper, dict(top_h=1.0)),
    (TopHWarper, TopHLogitsWarper, dict(top_h=0.02)),
], ids=lambda value: value.__name__ if isinstance(value, type) else "-".join(f"{k}={v}" for k, v in value.items()))
def test_our_warpers_keep_the_tokens_transformers_keeps(ours, theirs, settings):
    """Against transformers' own warper on logits with bf16's ties and top-k's -inf (fp32, then fp64 as the
    exactness tests run them), down to min_tokens_to_keep: the same tokens kept, each filter removing some."""
    for seed, dtype in itertools.product(range(3), (torch.float32, torch.float64)):
        generator = torch.Generator().manual_seed(seed)
        logits = TopKLogitsWarper(200)(None, (torch.randn(8, 1000, generator=generator) * 3).bfloat16().to(dtype))
        kept = ours(**settings)(None, logits)
        assert torch.equal(kept, theirs(**settings)(None, logits))
        counts = kept.isfinite().sum(-1)
        assert (counts >= settings.get("min_tokens_to_keep", 1)).all() and (counts < 200).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor splits the scan on CUDA")
@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=50, top_p=0.9),
                                      dict(temperature=0.7, top_p=0.95, min_p=0.05, epsilon_cutoff=3e-4),
                                      dict(temperature=0.7, top_h=0.5, typical_p=0.9, eta_cutoff=3e-4)])
def test_sampling_compiles_at_a_real_vocabulary_on_cuda(settings):
    """The sampled step's probabilities compiled at GLM-4.7-Flash's vocabulary over a verify block of 8, where
    transformers' own top-p made Inductor (torch 2.11) fail in code generation (typical-p scans its vocabulary too)."""
    chain = warpers(**settings)
    logits = torch.randn(1, 8, 154880, device="cuda", dtype=torch.bfloat16) * 3
    compiled = torch.compile(processed_probs, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(logits, chain), processed_probs(logits, chain))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_at_each_verified_position_is_transformers(penalty):
    """Position j of a verify block gets transformers' RepetitionPenaltyLogitsProcessor over the row's prompt (its
    left padding ignored, as generate does) followed by block[:j + 1]; and after the prompt alone."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows, width = 50, 3, 5
    prompt = torch.randint(0, vocab, (rows, 7), generator=generator)
    pad = torch.tensor([0, 2, 6])
    block = torch.randint(0, vocab, (rows, width), generator=generator)
    logits = torch.randn(rows, width, vocab, generator=generator)
    seen = seen_tokens(prompt, pad, vocab, torch.empty(rows, vocab + 1, dtype=torch.bool))
    ours = repetition_penalized(logits, seen, block, penalty)
    processor = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pad)
    for j in range(width):
        history = torch.cat([prompt, block[:, : j + 1]], dim=1)
        assert torch.equal(ours[:, j], processor(history, logits[:, j].clone()))
    assert torch.equal(repetition_penalized(logits[:, 0], seen, None, penalty), processor(prompt, logits[:, 0].clone()))


def _matches_transformers_over_verify_blocks(ours, references, seed: int) -> None:
    """`ours(logits [b, w, V], history [b, C], lengths [b], block [b, w] or None)` against transformers' processors
    `references` applied in turn: at each position j of a verify block over the row's history (of its own length,
    few distinct tokens, so sequences repeat) followed by block[:j + 1], and over the history alone (block None, one
    position: the first new token)."""
    generator = torch.Generator().manual_seed(seed)
    width, vocab, capacity = 5, 6, 40
    lengths = torch.tensor([1, 6, 12])
    history = torch.zeros(len(lengths), capacity, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        history[row, :length] = torch.randint(0, 4, (length,), generator=generator)
    block = torch.randint(0, 4, (len(lengths), width), generator=generator)
    logits = torch.randn(len(lengths), width, vocab, generator=generator)

    def reference(sequence, scores):
        for processor in references:
            scores = processor(sequence[None], scores[None].clone())[0]
        return scores

    verified, first = ours(logits, history, lengths, block), ours(logits[:, :1], history, lengths, None)
    for row, length in enumerate(lengths.tolist()):
        for j in range(width):
            sequence = torch.cat([history[row, :length], block[row, :j + 1]])
            assert torch.equal(verified[row, j], reference(sequence, logits[row, j]))
        assert torch.equal(first[row, 0], reference(history[row, :length], logits[row, 0]))
    assert verified.isinf().any()


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_repeated_ngrams_ban_at_each_verified_position_is_transformers(size):
    """transformers' NoRepeatNGramLogitsProcessor at each verified position and the first new token."""
    _matches_transformers_over_verify_blocks(
        lambda logits, history, lengths, block: repeated_ngrams_banned(logits, history, lengths, block, size),
        [NoRepeatNGramLogitsProcessor(size)], seed=size)


def test_sequence_biases_at_each_verified_position_are_transformers():
    """transformers' SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor (an EOS bad word kept) and
    SuppressTokensLogitsProcessor at each verified position and the first new token: sequences of one to four tokens,
    a prefix longer than a row's history among them."""
    sequence_bias = {(2,): -1.5, (1, 3): 2.0, (0, 1, 2): -0.7, (3, 3): 1.25, (1, 2, 0, 4): 3.0}
    bad_words, suppressed, eos = [[4], [1, 1, 5], [2, 0], [3]], [5], 3
    biases = SequenceBiases.of(6, sequence_bias, bad_words, suppressed, {eos})
    _matches_transformers_over_verify_blocks(
        lambda logits, history, lengths, block: sequence_biased(logits, history, lengths, block, biases),
        [SequenceBiasLogitsProcessor(sequence_bias), NoBadWordsLogitsProcessor(bad_words, [eos]),
         SuppressTokensLogitsProcessor(suppressed)], seed=0)
