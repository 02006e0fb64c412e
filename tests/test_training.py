import json

import pytest
import torch

import dflash_compile
from dflash_compile.drafter import load_drafter
from dflash_compile.testing import random_drafter_weights, save_drafter, tiny_drafter_config
from dflash_compile.training import DrafterTraining, block_loss, greedy_continuations, train_drafter


@pytest.mark.parametrize("layer_types", [("full_attention",) * 2, ("sliding_attention", "full_attention")])
def test_packed_training_forward_equals_drafting(tiny, tmp_path, layer_types):
    """Blocks packed into one training forward give the logits inference computes for each block alone."""
    model = tiny("qwen3_moe")
    config = tiny_drafter_config(model.config, block_size=4, layer_types=layer_types, sliding_window=5)
    drafter, ids = load_drafter(save_drafter(tmp_path / "d", config, random_drafter_weights(config)), model)
    tokens = torch.randint(0, 120, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in ids], dim=-1)
        anchors = torch.tensor([[3, 4, 11], [0, 9, 16]])
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        packed = drafter.packed_logits(features, tokens, anchors, embed, lm_head)
        for b in range(2):
            for i, anchor in enumerate(anchors[b].tolist()):
                cache = drafter.new_cache(1, 32, torch.float32, "cpu")
                drafter.add_context(cache, features[b:b + 1, :anchor], torch.tensor([anchor]))
                block = torch.full((1, 4), config["dflash_config"]["mask_token_id"])
                block[0, 0] = tokens[b, anchor]
                alone = drafter.draft_logits(embed(block), cache, lm_head)
                torch.testing.assert_close(packed[b, i], alone[0], atol=1e-5, rtol=1e-5)


def test_block_loss_weights_early_positions_more():
    labels = torch.zeros(1, 1, 3, dtype=torch.long)
    right, wrong = torch.tensor([10.0, 0.0]), torch.tensor([0.0, 10.0])
    first_wrong = torch.stack([wrong, right, right])[None, None]
    last_wrong = torch.stack([right, right, wrong])[None, None]
    assert block_loss(first_wrong, labels, gamma=1.0)[0] > block_loss(last_wrong, labels, gamma=1.0)[0]
    assert block_loss(last_wrong, labels, gamma=1.0)[1].tolist() == [1.0, 1.0, 0.0]


def test_continuations_are_the_targets_greedy_tokens(tiny):
    model = tiny("qwen3_moe")
    prompts = torch.randint(0, 120, (3, 5), generator=torch.Generator().manual_seed(1))
    sequences = greedy_continuations(model, prompts, 6, batch_size=2)
    assert sequences.shape == (3, 11) and torch.equal(sequences[:, :5], prompts)
    with torch.no_grad():
        for position in range(5, 11):
            assert torch.equal(model(sequences[:, :position]).logits[:, -1].argmax(-1), sequences[:, position])


SETTINGS = DrafterTraining(block_size=4, layers=1, steps=200, batch_size=16, prompt_length=8, continuation_length=24,
                           blocks_per_sequence=4, sequences=32, learning_rate=1e-2, warmup_steps=5,
                           checkpoint_every=10)


def _texts():
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 120, (64,), generator=generator).tolist() for _ in range(4)]


def _log(out):
    return [json.loads(line) for line in (out / "training" / "log.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_the_checkpoint_loads(tiny, tmp_path):
    model = tiny("qwen3_moe")
    out = train_drafter(model, _texts(), tmp_path / "drafter", settings=SETTINGS, mask_token_id=127,
                        progress=False)
    losses = [record["loss"] for record in _log(out)]
    assert len(losses) == SETTINGS.steps
    assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10
    fast = dflash_compile.optimize(model, drafter=out, compile=False)
    prompt = torch.tensor([_texts()[0][:8]])
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(fast.generate(prompt, max_new_tokens=12), expected)


def test_training_resumes_from_its_checkpoint(tiny, tmp_path):
    model = tiny("qwen3_moe")
    short = DrafterTraining(**{**SETTINGS.__dict__, "steps": 10})
    train_drafter(model, _texts(), tmp_path / "d", settings=short, mask_token_id=127, progress=False)
    state = torch.load(tmp_path / "d" / "training" / "state.pt", weights_only=False)
    assert state["step"] == 10
    train_drafter(model, _texts(), tmp_path / "d", settings=DrafterTraining(**{**SETTINGS.__dict__, "steps": 15}),
                  mask_token_id=127, progress=False)
    assert [record["step"] for record in _log(tmp_path / "d")] == list(range(15))


def test_training_errors_name_the_fix(tiny, tmp_path):
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="needs a mask token: pass mask_token_id="):
        train_drafter(model, _texts(), tmp_path / "a", settings=SETTINGS)
    with pytest.raises(ValueError, match="texts are strings: pass the target's tokenizer"):
        train_drafter(model, ["def f(): pass"], tmp_path / "b", settings=SETTINGS, mask_token_id=127)
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        train_drafter(model, _texts(), tmp_path / "c", settings=DrafterTraining(block_size=1), mask_token_id=127)
    with pytest.raises(ValueError, match="no text has 8 tokens"):
        train_drafter(model, [[1, 2, 3]], tmp_path / "d", settings=SETTINGS, mask_token_id=127)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
