"""The bundled default pair: small enough to ship, a real trained pair (held-out acceptance), exact outputs."""

import json

import pytest
import torch
import transformers

import dflash_compile
from dflash_compile.pair import DEFAULT_PAIR, acceptance_on_prompts, heldout_prompts, load_target


def test_the_bundled_pair_is_small_and_a_byte_level_moe():
    size = sum(f.stat().st_size for f in DEFAULT_PAIR.rglob("*") if f.is_file())
    assert size <= 20 * 2**20
    model, tokenizer = load_target(DEFAULT_PAIR / "target")
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 8
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 1e7  # a few million
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    assert tokenizer.backend_tokenizer.pre_tokenizer.__class__.__name__ == "ByteLevel"
    assert tokenizer.decode(tokenizer("def f(x):\n    return x  # é").input_ids) == "def f(x):\n    return x  # é"
    drafter_config = json.loads((DEFAULT_PAIR / "drafter" / "config.json").read_text())
    assert drafter_config["dflash_config"]["block_size"] == 8


def test_held_out_acceptance_and_identical_greedy_output():
    """Prompts from standard-library files that no training step saw: mean accepted length >= 2.5 with block 8,
    every output equal to the target's own generate (checked inside acceptance_on_prompts)."""
    prompts = heldout_prompts()
    assert len(prompts) == 24
    result = acceptance_on_prompts(None, prompts, max_new_tokens=128)
    assert result["identical"] == len(prompts)
    assert result["block_size"] == 8 and result["tau"] >= 2.5


def test_prompt_past_the_targets_context_is_refused():
    model, _ = load_target(DEFAULT_PAIR / "target")
    fast = dflash_compile.optimize(model, drafter=DEFAULT_PAIR / "drafter", compile=False)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 256; shorten the prompt"):
        fast.generate(torch.zeros(1, 200, dtype=torch.long), max_new_tokens=100)


@pytest.mark.inductor
def test_the_compiled_drafter_drafts_what_the_eager_one_does():
    """With compile=True the drafter's forward is compiled too (Inductor, no CUDA graphs): the same acceptance step
    by step as the eager drafter (acceptance depends on every draft), and the target's tokens."""
    model, tokenizer = load_target(DEFAULT_PAIR / "target")
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    runs = {}
    for compile in (False, True):
        fast = dflash_compile.optimize(model, drafter=DEFAULT_PAIR / "drafter", compile=compile, adaptive=False)
        runs[compile] = fast.generate(ids, max_new_tokens=48), fast.last_stats.accepted
    assert fast.decoder.draft_logits != fast.decoder.drafter.draft_logits  # the compiled one ran
    assert torch.equal(runs[True][0], runs[False][0]) and runs[True][1] == runs[False][1]
    assert sum(a for (a,) in runs[True][1]) > 0  # drafts were accepted: a comparison that can fail
