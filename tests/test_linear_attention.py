"""Linear-attention layers verify a block token by token (`stepwise_linear_attention`): the recurrent rule that
transformers' decode runs, the state after every token kept; prompts keep the chunked rule."""

import sys

import pytest
import torch

import dflash_compile
from dflash_compile.families import RECURRENT_KINDS
from dflash_compile.linear_attention import (STEPWISE_TOKENS, stepwise_delayed_value, stepwise_lightning,
                                             stepwise_linear_attention, stepwise_mamba1_scan, stepwise_mamba2_rule,
                                             stepwise_rule)
from dflash_compile.testing import OracleDrafter, in_installed_transformers, load_tiny_model, save_tiny_model

HEADS, K_DIM, V_DIM = 4, 16, 8


def modeling(model):
    return sys.modules[type(model.model.layers[0].linear_attn).__module__]


def rule_inputs(tokens: int, batch: int = 2, seed: int = 0):
    """query, key, value [b, t, heads, dim], g and beta [b, t, heads], as a GatedDeltaNet layer passes them."""
    generator = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(batch, tokens, HEADS, K_DIM, generator=generator) for _ in range(2))
    value = torch.randn(batch, tokens, HEADS, V_DIM, generator=generator)
    g = -torch.rand(batch, tokens, HEADS, generator=generator)
    beta = torch.rand(batch, tokens, HEADS, generator=generator)
    state = torch.randn(batch, HEADS, K_DIM, V_DIM, generator=generator)
    return query, key, value, g, beta, state


def test_a_block_runs_as_decode_runs_each_token(tiny):
    """The block's outputs and states are bit for bit those of one recurrent call per token (transformers' decode),
    and match the chunked rule's output and final state."""
    module = modeling(tiny("qwen3_5_moe"))
    chunked, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
    query, key, value, g, beta, state = rule_inputs(5)
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, states = stepwise_rule(chunked, recurrent)(query, key, value, g=g, beta=beta, initial_state=state, **options)
    assert out.shape == value.shape and states.shape == (2, 5, HEADS, K_DIM, V_DIM)
    decoded = state
    for t in range(5):
        step = slice(t, t + 1)
        token_out, decoded = recurrent(query[:, step], key[:, step], value[:, step], g=g[:, step],
                                       beta=beta[:, step], initial_state=decoded, **options)
        assert torch.equal(out[:, step], token_out) and torch.equal(states[:, t], decoded)
    chunk_out, chunk_state = chunked(query, key, value, g=g, beta=beta, initial_state=state, **options)
    torch.testing.assert_close(out, chunk_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states[:, -1], chunk_state, rtol=1e-4, atol=1e-5)


def test_a_mamba2_block_runs_as_decode_runs_each_token(tiny):
    """Granite 4.0-H's Mamba2 scan over a block from a state: bit for bit one recurrent update per token on the
    per-head parameters its mixer expands for decode (the update writes the state in place: the given one is
    untouched), the state after each token kept; and within rounding of the chunked scan."""
    model = tiny("granitemoehybrid")
    mixer = model.model.layers[0].mamba
    module = sys.modules[type(mixer).__module__]
    chunked, recurrent = module.mamba2_chunk_scan, module.mamba2_selective_state_update
    generator = torch.Generator().manual_seed(0)
    batch, tokens, heads, head_dim, groups, size = 2, 5, mixer.num_heads, mixer.head_dim, mixer.n_groups, 16
    hidden = torch.randn(batch, tokens, heads, head_dim, generator=generator)
    dt = torch.randn(batch, tokens, heads, generator=generator)
    B, C = (torch.randn(batch, tokens, groups, size, generator=generator) for _ in range(2))
    A = -torch.exp(mixer.A_log.float())
    state = torch.randn(batch, heads, head_dim, size, generator=generator)
    given = state.clone()
    options = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, z=None)
    out, states = stepwise_mamba2_rule(chunked, recurrent)(hidden, dt, A, B, C, 16, initial_states=state,
                                                           return_final_states=True, **options)
    assert torch.equal(state, given) and states.shape == (batch, tokens, heads, head_dim, size)
    decoded = state.clone()
    for t in range(tokens):  # as the mixer's one-token path calls it
        token_out = recurrent(decoded, hidden[:, t], dt[:, t, :, None].expand(-1, -1, head_dim),
                              A[:, None, None].expand(-1, head_dim, size), B[:, t], C[:, t],
                              mixer.D[:, None].expand(-1, head_dim), z=None,
                              dt_bias=mixer.dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
        assert torch.equal(out[:, t], token_out) and torch.equal(states[:, t], decoded)
    chunk_out, chunk_state = chunked(hidden, dt, A, B, C, 16, initial_states=state, return_final_states=True,
                                     **options)
    torch.testing.assert_close(out, chunk_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[:, -1], chunk_state, rtol=1e-4, atol=1e-4)


class StateCache:
    """The calls transformers 5.25's `mamba_scan_forward` makes on a cache: one layer's recurrent state."""

    def __init__(self, state):
        self.state, self.updated = state, None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.state

    def update_recurrent_state(self, state, layer_idx, **kwargs):
        self.updated = state

    def get_recurrent_states_to_keep(self, layer_idx):
        return 0


@pytest.mark.skipif(not in_installed_transformers("jamba"), reason="Jamba's scan takes the cache from 5.25")
@pytest.mark.parametrize("tokens", [5, STEPWISE_TOKENS + 3])
def test_a_jamba_block_runs_as_decode_runs_each_token(tiny, tokens):
    """Jamba's (Mamba1) scan from a cached state: bit for bit one recurrent update per token on a copy of the state
    (the cached one untouched), the cache given the state after each token of a verify block, or the last one
    after a longer prompt chunk; and from a zero state within rounding of transformers' own scan (which starts from
    zeros whatever the cache holds)."""
    mixer = tiny("jamba").model.layers[0].mamba
    module = sys.modules[type(mixer).__module__]
    chunked, recurrent = module.mamba_scan_forward, module.mamba_selective_state_update
    generator = torch.Generator().manual_seed(0)
    batch, inner, size = 2, mixer.intermediate_size, mixer.ssm_state_size
    hidden, time_step, gate = (torch.randn(batch, inner, tokens, generator=generator) for _ in range(3))
    B, C = (torch.randn(batch, tokens, size, generator=generator) for _ in range(2))
    state = torch.randn(batch, inner, size, generator=generator)
    cache, given = StateCache(state), state.clone()
    out = stepwise_mamba1_scan(chunked, recurrent)(mixer, hidden, time_step, B, C, gate, cache)
    assert torch.equal(state, given) and out.shape == hidden.shape
    decoded = state.clone()
    for t in range(tokens):  # as the scan's one-token path calls it
        token_out = recurrent(decoded, hidden[..., t], time_step[..., t], -torch.exp(mixer.A_log.float()), B[:, t],
                              C[:, t], mixer.D, z=gate[..., t], dt_bias=mixer.dt_proj.bias.float(), dt_softplus=True)
        assert torch.equal(out[..., t], token_out)
        if tokens <= STEPWISE_TOKENS:
            assert torch.equal(cache.updated[:, t], decoded)
    assert torch.equal(cache.updated if tokens > STEPWISE_TOKENS else cache.updated[:, -1], decoded)
    zeros = StateCache(torch.zeros_like(state))
    stepped = stepwise_mamba1_scan(chunked, recurrent)(mixer, hidden, time_step, B, C, gate, zeros)
    own = StateCache(None)
    torch.testing.assert_close(stepped, chunked(mixer, hidden, time_step, B, C, gate, own), rtol=1e-4, atol=1e-4)


class LinearCache:
    """The calls MiniMax's lightning attention makes on a cache: one layer's state."""

    def __init__(self, state):
        self.state = state

    def get_linear_cache(self, layer_idx):
        return self.state

    def set_linear_cache(self, layer_idx, state):
        self.state = state


@pytest.mark.parametrize("tokens", [5, STEPWISE_TOKENS + 3])
def test_a_lightning_block_runs_as_decode_runs_each_token(tiny, tokens):
    """MiniMax's lightning attention from a cached state: a verify block bit for bit its own forward on one token at
    a time (its decode), the cache given the state after each token; a longer prompt chunk runs the forward as it is
    (its own recurrence: the last state). Both within rounding of each other."""
    layer = tiny("minimax").model.layers[0].self_attn
    forward = type(layer).forward
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens, layer.qkv_proj.in_features, generator=generator)
    state = torch.randn(2, layer.num_attention_heads, layer.head_dim, layer.head_dim, generator=generator)
    cache = LinearCache(state)
    with torch.no_grad():
        out, _ = stepwise_lightning(forward, forward)(layer, hidden_states=hidden, cache=cache)
        decoded, outputs = LinearCache(state), []
        for t in range(tokens):
            outputs.append(forward(layer, hidden[:, t:t + 1], None, None, decoded)[0])
            if tokens <= STEPWISE_TOKENS:
                assert torch.equal(out[:, t:t + 1], outputs[-1]) and torch.equal(cache.state[:, t], decoded.state)
        whole = LinearCache(state)
        torch.testing.assert_close(forward(layer, hidden, None, None, whole)[0], torch.cat(outputs, dim=1))
    if tokens > STEPWISE_TOKENS:
        assert torch.equal(cache.state, whole.state)


class ConvCache(StateCache):
    """The calls ZAYA1's CCA projection makes on a cache: a conv window (the input with the window in front) and a
    recurrent state."""

    def __init__(self, window, state):
        super().__init__(state)
        self.window = window

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.window

    def update_conv_state(self, conv_input, layer_idx, conv_kernel_size=None):
        return torch.cat([self.window, conv_input], dim=-1)


@pytest.mark.skipif(not in_installed_transformers("zaya"), reason="ZAYA1's CCA takes the conv input from 5.25")
def test_a_cca_block_leaves_each_tokens_delayed_value(tiny):
    """ZAYA1's CCA projection from a cached state: the same queries, keys and values as its own forward, and the
    cache given each token's delayed value projection (the state after each token) where the forward hands it only
    the last token's."""
    projection = tiny("zaya").model.layers[0].self_attn.qkv_proj
    forward = type(projection).forward
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, projection.hidden_size, generator=generator)
    window = torch.randn(2, projection.q_proj.out_features + projection.k_proj.out_features,
                         projection.conv_kernel_size, generator=generator)
    state = torch.randn(2, projection.v_proj_delayed.out_features, generator=generator)
    stepped, plain = ConvCache(window, state), ConvCache(window, state)
    with torch.no_grad():
        outputs = stepwise_delayed_value(forward, forward)(projection, hidden, stepped)
        for out, expected in zip(outputs, forward(projection, hidden, plain)):
            assert torch.equal(out, expected)
        assert torch.equal(stepped.updated, projection.v_proj_delayed(hidden))
    assert stepped.updated.shape == (2, 5, state.shape[-1]) and torch.equal(stepped.updated[:, -1], plain.updated)


@pytest.mark.skipif(not in_installed_transformers("jamba"), reason="Jamba's scan takes the cache from 5.25")
def test_jamba_prompt_chunks_longer_than_a_block_resume_from_the_state(tiny):
    """A 150-token prompt in chunks of 70, 70 and 10: the second chunk, longer than a verify block, resumes from the
    first one's state (transformers' own multi-token scan would restart from zeros): each Mamba layer's state after
    the prompt is within rounding of model.generate's, which takes the prompt in one forward, and so are the
    tokens."""
    model = tiny("jamba")
    ids = torch.randint(3, 127, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=16)
        own = model(ids, use_cache=True).past_key_values
    fast = dflash_compile.optimize(model, adaptive=False, compile=False, prefill_chunk=70)
    forward, lengths = fast.decoder._target_forward, []
    fast.decoder._target_forward = lambda ids, *args, **kwargs: lengths.append(ids.shape[1]) or forward(
        ids, *args, **kwargs)
    fast.generate(ids, max_new_tokens=1)  # the prompt alone
    assert lengths == [70, 70, 10]
    mamba = [layer for layer, kind in enumerate(model.config.layers_block_type) if kind == "mamba"]
    for layer in mamba:
        torch.testing.assert_close(fast.decoder.target_cache.get_recurrent_state(layer),
                                   own.get_recurrent_state(layer), rtol=1e-4, atol=1e-5)
    assert torch.equal(fast.generate(ids, max_new_tokens=16), expected)


@pytest.mark.parametrize("tokens, with_state", [(5, False), (STEPWISE_TOKENS + 1, True)])
def test_prompts_keep_the_chunked_rule(tiny, tokens, with_state):
    """No state yet (a prompt's first chunk) or a block longer than STEPWISE_TOKENS: the chunked rule, unchanged."""
    module = modeling(tiny("qwen3_5_moe"))
    chunked = module.torch_chunk_gated_delta_rule
    query, key, value, g, beta, state = rule_inputs(tokens)
    state = state if with_state else None
    options = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = stepwise_rule(chunked, module.torch_recurrent_gated_delta_rule)(query, key, value, **options)
    expected_out, expected_final = chunked(query, key, value, **options)
    assert torch.equal(out, expected_out) and torch.equal(final, expected_final)


def test_the_rule_is_swapped_inside_the_context_only(tiny):
    """Inside: the modeling module's chunked rule is `stepwise_rule` (one object for every entry, nested entries
    included: compiled steps are guarded on it); after: transformers' own again."""
    model = tiny("qwen3_5_moe")
    module = modeling(model)
    own = module.torch_chunk_gated_delta_rule
    with stepwise_linear_attention(model):
        swapped = module.torch_chunk_gated_delta_rule
        with stepwise_linear_attention(model):
            assert module.torch_chunk_gated_delta_rule is swapped
        assert module.torch_chunk_gated_delta_rule is swapped
    assert module.torch_chunk_gated_delta_rule is own and swapped is not own and swapped.stepwise
    with stepwise_linear_attention(model):
        assert module.torch_chunk_gated_delta_rule is swapped
    with stepwise_linear_attention(tiny("olmoe")):  # no linear attention: nothing changes
        assert module.torch_chunk_gated_delta_rule is own


def test_a_block_longer_than_stepwise_is_refused(tiny):
    model = tiny("qwen3_5_moe")
    oracle = OracleDrafter(torch.zeros(1, 8, dtype=torch.int64), None, STEPWISE_TOKENS + 1, vocab_size=128)
    with pytest.raises(ValueError, match=f"the drafter's block of {STEPWISE_TOKENS + 1} tokens is longer than "
                                         "Qwen3_5MoeForCausalLM's linear-attention layers verify token by token"):
        dflash_compile.optimize(model, drafter=oracle, compile=False)
    dflash_compile.optimize(tiny("olmoe"), drafter=oracle, compile=False)  # no linear attention: any block


@pytest.mark.parametrize("family, overrides, routed", [
    ("granitemoehybrid", dict(num_local_experts=0), False),  # Granite 4.0-H's dense releases (H-Micro)
    ("nemotron_h", dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"]), False),  # dense
    ("nemotron_h", dict(moe_latent_size=32), True),  # Nemotron 3 Super's experts in a narrower latent width
])
def test_hybrid_releases_verify_partial_blocks_like_generate(tmp_path, family, overrides, routed):
    """Granite 4.0-H's and Nemotron-H's dense releases (Mamba2 and attention layers, MLPs, no experts), and
    Nemotron-H's latent MoE (the experts between projections to and from `moe_latent_size`), keep `generate`'s
    tokens on a left-padded batch through partly accepted blocks."""
    model = load_tiny_model(family, directory=save_tiny_model(family, tmp_path, **overrides))
    assert bool(dflash_compile.families.experts_modules(model)) == routed
    ids = torch.randint(3, 127, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    oracle = OracleDrafter(expected, mask, 4, corruption=0.3, vocab_size=128)
    fast = dflash_compile.optimize(model, drafter=oracle, adaptive=False, compile=False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=20), expected)
    assert 1 < fast.last_stats.tau < 4


def test_the_multimodal_model_verifies_partial_blocks_like_generate(tmp_path):
    """A Qwen3.5-MoE checkpoint as released (image-text-to-text: the decoder under `model.language_model`) keeps
    `generate`'s tokens through partly accepted blocks."""
    from transformers import AutoModelForImageTextToText

    from dflash_compile.testing import tiny_multimodal_config

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(tiny_multimodal_config("qwen3_5_moe")).save_pretrained(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=20)
    oracle = OracleDrafter(expected, None, 6, corruption=0.3, vocab_size=128)
    fast = dflash_compile.optimize(model, drafter=oracle, adaptive=False, compile=False)
    assert torch.equal(fast.generate(ids, max_new_tokens=20), expected)
    assert 1 < fast.last_stats.tau < 6  # some blocks kept in part


def test_the_states_are_committed_from_the_steps_outputs(tiny):
    """A step replayed from a CUDA graph recomputes its outputs in place but redoes none of the Python side effects
    that leave the linear-attention states pending in the cache: `generate` commits the states the step returns
    (`TargetCache.pending_linear`). A replay is emulated here by emptying what the step left pending."""
    from tests.test_speculative import NEW_TOKENS, prompts, reference

    model = tiny("qwen3_5_moe")
    ids, mask = prompts(3)
    expected = reference(model, ids, mask)
    oracle = OracleDrafter(expected, mask, 6, corruption=0.3, vocab_size=128)
    fast = dflash_compile.optimize(model, drafter=oracle, adaptive=False, compile=False)
    step = fast.decoder.verify_step

    def replayed(block, cache, *rest):
        outputs = step(block, cache, *rest)
        cache.pending_conv.clear()
        cache.pending_recurrent.clear()
        return outputs

    fast.decoder.verify_step = replayed
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    assert 1 < fast.last_stats.tau < 6  # some blocks kept in part


def test_a_new_generation_reuses_the_state_buffers(tiny):
    """The next generation of the same shape commits its linear-attention states into the previous one's tensors
    (`TargetCache.reset` keeps them as spares): a step replayed from CUDA graphs reads them at their captured
    addresses, and torch.compile's CUDA-graph trees would record anew for new ones."""
    from tests.test_speculative import NEW_TOKENS, prompts, reference

    model = tiny("qwen3_5_moe")
    ids, mask = prompts(3)
    expected = reference(model, ids, mask)
    fast = dflash_compile.optimize(model, drafter=OracleDrafter(expected, mask, 6, corruption=0.3, vocab_size=128),
                                   adaptive=False, compile=False)

    def states():
        cache = fast.decoder.target_cache
        return [cache, *cache.conv.values(), *cache.recurrent.values()]

    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    first = states()
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    linear_layers = [kind for kind in fast.decoder.attention_kinds if kind in RECURRENT_KINDS]
    assert len(first) == 1 + 2 * len(linear_layers) > 1
    assert all(a is b for a, b in zip(first, states(), strict=True))
