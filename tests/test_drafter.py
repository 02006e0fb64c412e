"""DFlash drafter: both checkpoint formats, forward semantics (FORMATS.md), pairing errors."""

import json

import pytest
import torch
import transformers

import dflash_compile
from dflash_compile.cache import RowCache
from dflash_compile.drafter import DFlashDrafter, DrafterConfig, DrafterPairingError, load_drafter
from dflash_compile.expert_store import _STORES_BY_ROOT
from dflash_compile.testing import in_installed_transformers, random_drafter_weights, save_drafter, tiny_drafter_config


def features(model, length, seed=0):
    width = 2 * model.config.hidden_size  # tiny drafters read two target layers
    return torch.randn(1, length, width, generator=torch.Generator().manual_seed(seed))


def block_embeds(model, drafter, anchor=5):
    block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
    block[0, 0] = anchor
    return model.get_input_embeddings()(block)


def cached_forward(drafter, context, chunks, embeds):
    """The drafter as generation runs it: context added in chunks, then one block forward."""
    cache = RowCache(1, 64, torch.float32, "cpu")
    start = 0
    for size in chunks:
        drafter.add_context(cache, context[:, start: start + size], torch.tensor([size]))
        start += size
    with torch.no_grad():
        return drafter(embeds, cache)


def test_same_draft_from_z_lab_and_transformers_format(tiny, tmp_path):
    model = tiny("mixtral")
    config = tiny_drafter_config(model.config, block_size=5, sliding_window=64)
    weights = random_drafter_weights(config)
    z_lab, _ = load_drafter(save_drafter(tmp_path / "z", config, weights), model)
    hf_dir = save_drafter(tmp_path / "hf", config, weights, transformers_format=True)
    hf, _ = load_drafter(hf_dir, model)
    hf_module, _ = load_drafter(transformers.AutoModel.from_pretrained(hf_dir), model)  # an in-memory module
    context = features(model, 7)
    lm_head = model.get_output_embeddings()
    drafts = []
    for drafter in (z_lab, hf, hf_module):
        cache = RowCache(1, 64, torch.float32, "cpu")
        drafter.add_context(cache, context, torch.tensor([7]))
        with torch.no_grad():
            drafts.append(drafter.propose(torch.tensor([5]), cache, model.get_input_embeddings(), lm_head)[0])
    assert drafts[0].shape == (1, 4)
    assert torch.equal(drafts[0], drafts[1]) and torch.equal(drafts[0], drafts[2])


def test_full_attention_layers_match_transformers_assistant_model(tiny, tmp_path):
    """Non-causal full layers over [context ; block]: transformers' own MuseGlimmerAssistantModel is the oracle."""
    model = tiny("olmoe")
    config = tiny_drafter_config(model.config, block_size=4, sliding_window=64)
    weights = random_drafter_weights(config, seed=1)
    hf_dir = save_drafter(tmp_path / "hf", config, weights, transformers_format=True)
    assistant = transformers.AutoModel.from_pretrained(hf_dir).eval()
    ours, _ = load_drafter(hf_dir, model)
    context, embeds = features(model, 6), block_embeds(model, ours)
    with torch.no_grad():
        expected = assistant(noise_embeds=embeds, context_hidden_states=context,
                             position_ids=torch.arange(10)[None]).last_hidden_state
    torch.testing.assert_close(cached_forward(ours, context, [3, 1, 2], embeds), expected, atol=1e-5, rtol=1e-5)


def naive_sliding_forward(drafter, context, embeds, window):
    """FORMATS.md written out for one row with no cache: sliding layers causal, key kept when q - k < window."""
    n, block = context.shape[1], embeds.shape[1]
    ctx = drafter.hidden_norm(drafter.fc(context))
    positions = torch.arange(n + block)[None]
    cos, sin = drafter.rotary_emb(ctx, positions)
    q_pos, k_pos = positions[0, n:, None], positions[0, None, :]
    visible = (q_pos - k_pos < window) & (k_pos <= q_pos)
    hidden = embeds
    for layer in drafter.layers:
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden)
        kv_input = torch.cat([ctx, normed], dim=1)
        q = attn._heads(normed, attn.q_proj, attn.heads)
        k = attn._heads(kv_input, attn.k_proj, attn.kv_heads)
        v = attn._heads(kv_input, attn.v_proj, attn.kv_heads)
        from dflash_compile.drafter import _rope

        q, k = _rope(attn.q_norm(q), cos[:, n:], sin[:, n:]), _rope(attn.k_norm(k), cos, sin)
        k, v = (t.repeat_interleave(attn.heads // attn.kv_heads, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / attn.head_dim**0.5
        out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, block, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden)


def test_sliding_layers_follow_z_lab_semantics(tiny, tmp_path):
    model = tiny("mixtral")
    config = tiny_drafter_config(model.config, block_size=6, layer_types=["sliding_attention"] * 2)
    config["sliding_window"] = 5  # smaller than context + block: the window cuts both context and block keys
    drafter, _ = load_drafter(save_drafter(tmp_path / "d", config, random_drafter_weights(config)), model)
    context, embeds = features(model, 9), block_embeds(model, drafter)
    with torch.no_grad():
        expected = naive_sliding_forward(drafter, context, embeds, window=5)
    torch.testing.assert_close(cached_forward(drafter, context, [4, 5], embeds), expected, atol=1e-5, rtol=1e-5)


def test_config_layouts_agree():
    target = transformers.MixtralConfig(num_hidden_layers=4, hidden_size=64, vocab_size=128)
    nested = DrafterConfig.from_dict(tiny_drafter_config(target, block_size=8, nested=True))
    top_level = DrafterConfig.from_dict(tiny_drafter_config(target, block_size=8, nested=False))
    assert nested == top_level and nested.block_size == 8 and nested.target_layer_ids == (0, 3)


def test_default_layer_ids_follow_the_reference_spacing(tiny, tmp_path):
    model = tiny("glm4_moe")  # 3 target layers
    config = tiny_drafter_config(model.config)
    del config["dflash_config"]["target_layer_ids"]
    weights = random_drafter_weights(tiny_drafter_config(model.config))
    _, ids = load_drafter(save_drafter(tmp_path / "d", config, weights), model)
    assert ids == (1, 0)  # round(1 + i * (3 - 4) / (2 - 1)) for i in 0, 1


def _broken(model, tmp_path, edit_config=None, edit_weights=None):
    config = tiny_drafter_config(model.config)
    weights = random_drafter_weights(config)
    if edit_config:
        edit_config(config)
    if edit_weights:
        edit_weights(weights)
    return save_drafter(tmp_path / "bad", config, weights)


@pytest.mark.parametrize(
    "edit_config, edit_weights, message",
    [
        (lambda c: c.update(hidden_size=32), None, r"hidden_size: drafter has 32, target has 64"),
        (None, lambda w: w.update({"fc.weight": torch.zeros(64, 192)}),
         r"fc.weight has shape \[64, 192\], expected \[64, 128\]"),
        (lambda c: c.update(vocab_size=256), None, r"vocab_size: drafter has 256, target has 128"),
        (lambda c: c["dflash_config"].update(mask_token_id=128), None,
         r"mask_token_id 128 is outside the target's vocabulary \(vocab_size 128\)"),
        (lambda c: c.update(num_target_layers=36), None, r"num_target_layers: drafter has 36, target has 2"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 5]), None,
         r"target_layer_ids \[0, 5\] include \[5\], outside the target's 2 layers"),
        (lambda c: c.update(layer_types=["full_attention"]), None,
         r"layer_types has 1 entries but num_hidden_layers is 2"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=None), None,
         "sliding_attention layers but no sliding_window"),
        (lambda c: c["dflash_config"].update(block_size=1), None, "block_size is 1; it must be at least 2"),
    ],
)
def test_pairing_errors_name_the_field_and_both_values(tiny, tmp_path, edit_config, edit_weights, message):
    model = tiny("mixtral")
    path = _broken(model, tmp_path, edit_config, edit_weights)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DrafterPairingError, match=message):
        dflash_compile.optimize(model, drafter=path)
    assert model not in _STORES_BY_ROOT  # nothing compiled or registered
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_not_a_checkpoint(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_drafter(tmp_path, tiny("olmoe"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights"):
        load_drafter(tmp_path, tiny("olmoe"))
    with pytest.raises(TypeError, match="drafter must be a checkpoint directory or a drafter module, not int"):
        load_drafter(3, tiny("olmoe"))


def test_drafter_module_is_validated_too(tiny, tmp_path):
    model = tiny("mixtral")
    config = DrafterConfig.from_dict(tiny_drafter_config(model.config) | {"vocab_size": 64})
    with pytest.raises(DrafterPairingError, match="vocab_size: drafter has 64, target has 128"):
        load_drafter(DFlashDrafter(config, 2), model)


def test_yarn_rope_and_output_options_are_applied(tiny, tmp_path):
    model = tiny("gpt_oss")
    config = tiny_drafter_config(model.config, block_size=4, input_embedding_scale=2.0, output_multiplier=0.5,
                                 final_logit_softcapping=3.0)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "rope_theta": 10000.0}
    drafter, _ = load_drafter(save_drafter(tmp_path / "d", config, random_drafter_weights(config)), model)
    assert drafter.rotary_emb.rope_type == "yarn" and drafter.rotary_emb.attention_scaling > 1
    cache = RowCache(1, 32, torch.float32, "cpu")
    drafter.add_context(cache, features(model, 5), torch.tensor([5]))
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    block = torch.tensor([[7, *[drafter.config.mask_token_id] * 3]])
    with torch.no_grad():
        hidden = drafter(embed(block) * 2.0, cache)  # the block is embedded with input_embedding_scale
        expected = torch.tanh(lm_head(hidden[:, 1:]) * 0.5 / 3.0) * 3.0
        logits = drafter.draft_logits(embed(block) * 2.0, cache, lm_head)
        drafts, q = drafter.propose(torch.tensor([7]), cache, embed, lm_head)
    torch.testing.assert_close(logits, expected)
    assert logits.abs().max() <= 3.0
    assert torch.equal(drafts, expected.argmax(-1)) and q is None


def test_flattened_hyper_connection_streams_reach_the_drafter_as_their_mean():
    """Qwen4-Exp's decoder layers output their streams as one vector a token ([batch, tokens, streams x hidden]): a
    drafter is conditioned on their mean, as on HY V4's [batch, tokens, streams, hidden]; one stream as it is."""
    from dflash_compile.drafter import context_features

    streams, last = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 8)
    features = context_features((None, streams.flatten(-2), last), (0, 1), hidden_size=8)
    assert torch.equal(features, torch.cat([streams.mean(dim=2), last], dim=-1))


def test_hyper_connection_streams_and_an_fp32_head_reach_the_drafter(tiny, random_drafter):
    """HY V4's decoder layers output hyper-connection streams ([batch, tokens, streams, hidden]) and its bf16 model
    keeps an fp32 lm_head: a drafter is conditioned on each captured layer's mean stream (the last layer's is one,
    after the model's stream head and final norm), and its hidden states go through the head in the head's dtype, so
    speculative generation runs in bf16."""
    from dflash_compile.drafter import context_features

    model = tiny("hy_v4", torch.bfloat16)
    hidden = model.config.hidden_size
    ids = torch.randint(3, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    assert states[1].shape == (2, 9, model.config.hc_mult, hidden) and model.lm_head.weight.dtype == torch.float32
    features = context_features(states, (0, 2), hidden)
    assert states[3].shape == (2, 9, hidden)
    assert torch.equal(features, torch.cat([states[1].mean(dim=2), states[3]], dim=-1))
    fast = dflash_compile.optimize(model, random_drafter(model), adaptive=False, compile=False)
    out = fast.generate(ids, max_new_tokens=6)
    assert out.shape == (2, 15) and torch.equal(out[:, :9], ids)


@pytest.mark.skipif(not in_installed_transformers("zaya"), reason="ZAYA1: transformers 5.25")
def test_an_fp32_residual_stream_reaches_a_bf16_drafter(tiny, random_drafter):
    """ZAYA1 keeps its residual stream in fp32 in a bf16 model (its layers' outputs are fp32): the drafter takes the
    captured features in its own dtype."""
    model = tiny("zaya", torch.bfloat16)
    ids = torch.randint(3, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    assert states[1].dtype == torch.float32
    fast = dflash_compile.optimize(model, random_drafter(model), adaptive=False, compile=False)
    out = fast.generate(ids, max_new_tokens=6)
    assert out.shape == (2, 15) and torch.equal(out[:, :9], ids)
