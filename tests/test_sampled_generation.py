"""optimize(...).generate(do_sample=True) samples the target's own distribution (statistical, end to end)."""

import pytest
import torch

import dflash_compile
import dflash_compile.speculative
from dflash_compile.sampling import processed_probs, warpers
from dflash_compile.testing import OracleDrafter, random_drafter_weights, save_drafter, tiny_drafter_config

SETTINGS = dict(temperature=0.7, top_k=2, top_p=1.0)  # 2 candidates per step: 8 joint outcomes of 3 tokens
ROWS, NEW = 50_000, 3  # a 2% bias then gives p ~ 2e-11 (1e-19 at 100k rows; 3e-3 at 20k)
PROMPT = torch.tensor([[5, 17, 42, 99]])


def exact_joint(model):
    """P(first three generated tokens) under the target with SETTINGS, by enumeration."""
    chain = warpers(**SETTINGS)
    joint = {(): 1.0}
    for _ in range(NEW):
        grown = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], dim=1)).logits[0, -1]
            probs = processed_probs(logits, chain).double()
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        joint = grown
    return joint


def p_value(samples: torch.Tensor, joint: dict) -> float:
    """Chi-square goodness of fit of [N, 3] samples to `joint`; a sample outside its support gives 0."""
    counts = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    if set(counts) - set(joint):
        return 0.0
    n = len(samples)
    statistic = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in joint.items())
    return float(torch.special.gammaincc(torch.tensor((len(joint) - 1) / 2), torch.tensor(statistic / 2)))


@pytest.fixture(scope="module")
def model_and_joint(tiny_dirs):
    from dflash_compile.testing import load_tiny_model

    model = load_tiny_model("mixtral", directory=tiny_dirs("mixtral"))
    return model, exact_joint(model)


def sample(fast, seed):
    ids = PROMPT.repeat(ROWS, 1)
    out = fast.generate(ids, max_new_tokens=NEW, do_sample=True, generator=torch.Generator().manual_seed(seed),
                        eos_token_id=-1, **SETTINGS)
    return out[:, PROMPT.shape[1]:]


def test_target_generate_passes_the_test(model_and_joint):
    model, joint = model_and_joint
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(PROMPT.repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, eos_token_id=-1,
                             pad_token_id=0, **SETTINGS)
    assert p_value(out[:, PROMPT.shape[1]:], joint) > 1e-3


@pytest.mark.parametrize("drafts", ["sampled", "argmax", "oracle"])
def test_speculative_sampling_matches_the_target(model_and_joint, drafts, tmp_path):
    model, joint = model_and_joint
    if drafts == "oracle":  # deterministic drafts that are often right: long accepted runs
        greedy = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW + 4)
        drafter = OracleDrafter(greedy.repeat(ROWS, 1), None, block_size=4)
    else:
        config = tiny_drafter_config(model.config, block_size=4)
        drafter = save_drafter(tmp_path / "d", config, random_drafter_weights(config))
    fast = dflash_compile.optimize(model, adaptive=False, drafter=drafter)
    samples = sample(fast, seed=1) if drafts != "argmax" else fast.generate(
        PROMPT.repeat(ROWS, 1), max_new_tokens=NEW, do_sample=True, argmax_drafts=True, eos_token_id=-1,
        generator=torch.Generator().manual_seed(1), **SETTINGS)[:, PROMPT.shape[1]:]
    assert p_value(samples, joint) > 1e-3
    if drafts == "oracle":
        assert fast.last_stats.tau > 1.2  # many drafts were accepted: the accept path is what was tested


def test_a_two_percent_bias_fails_the_test(model_and_joint, monkeypatch):
    """A test-only variant that moves 2% of every step's probability to its likeliest token is caught."""
    model, joint = model_and_joint

    def biased(logits, chain):
        probs = processed_probs(logits, chain)
        top = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)
        return 0.98 * probs + 0.02 * top

    monkeypatch.setattr(dflash_compile.speculative, "processed_probs", biased)
    fast = dflash_compile.optimize(model, adaptive=False, drafter=None, compile=False)
    assert p_value(sample(fast, seed=2), joint) < 1e-3


def test_a_seeded_generator_reproduces_samples(model_and_joint, tmp_path):
    model, _ = model_and_joint
    config = tiny_drafter_config(model.config, block_size=4)
    fast = dflash_compile.optimize(model, adaptive=False, drafter=save_drafter(tmp_path / "d", config, random_drafter_weights(config)),
                                   compile=False)
    ids = PROMPT.repeat(4, 1)

    def run(seed):
        return fast.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.0,
                             generator=torch.Generator().manual_seed(seed))

    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(row) for row in first[:, PROMPT.shape[1]:].tolist()}) > 1  # rows draw independently
