"""Grouped-query attention on the cache's keys and values as they are: the numbers of transformers' own attention
functions, no `repeat_kv` copies inside the decoder's forwards, the user's implementation back afterwards."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.models.gpt_oss import modeling_gpt_oss

import dflash_compile
from dflash_compile.attention import NAME, grouped_attention, grouped_query_attention, row_starts

MIN = torch.finfo(torch.float32).min


def attention_inputs(heads=8, kv_heads=2, t=3, slots=16, d=16, per_head_mask=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, t, heads, d, generator=generator).transpose(1, 2)  # as the attention layers pass it
    key, value = (torch.randn(1, kv_heads, slots, d, generator=generator) for _ in range(2))
    visible = torch.rand(1, heads if per_head_mask else 1, t, slots, generator=generator) > 0.3
    visible[..., 0] = True
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False,
                             sinks=torch.randn(heads, generator=generator))
    return module, query, key, value, torch.where(visible, 0.0, MIN)


@pytest.mark.parametrize("per_head_mask", [False, True])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_sdpa_numbers_without_the_copies(t, per_head_mask):
    module, query, key, value, mask = attention_inputs(t=t, per_head_mask=per_head_mask)
    expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    out, weights = grouped_query_attention(module, query, key, value, mask, scaling=0.25)
    assert out.shape == expected.shape == (1, t, 8, 16) and weights is None
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("per_head_mask", [False, True])
@pytest.mark.parametrize("t", [1, 5, 40, 80])
def test_sink_softmax_is_gpt_oss_eager_attention(t, per_head_mask):
    """The sink as one more key slot of SDPA (`_sink_attention`) gives gpt-oss's eager numbers, zeros for a query
    that sees no slot (the first); folded queries up to 64 tokens here (`folding_pays`), unfolded beyond."""
    module, query, key, value, mask = attention_inputs(t=t, per_head_mask=per_head_mask)
    mask[:, :, 0] = MIN
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert not expected[:, 0].any()
    out, _ = grouped_query_attention(module, query, key, value, mask, scaling=0.25, s_aux=module.sinks)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_sink_softmax_in_bf16_is_as_close_to_fp32_as_gpt_oss_eager_attention():
    """In bf16 the SDPA sink path stays at least as close to the fp32 numbers as transformers' own bf16 eager
    attention (whose score tensors round to bf16 between the mask, the max and the softmax)."""
    module, query, key, value, mask = attention_inputs(heads=16, kv_heads=2, t=24, slots=256, d=64)
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=0.125)
    bf16 = [x.bfloat16() for x in (query, key, value, mask)]
    module.sinks = module.sinks.bfloat16()
    theirs, _ = modeling_gpt_oss.eager_attention_forward(module, *bf16, scaling=0.125)
    ours, _ = grouped_query_attention(module, *bf16, scaling=0.125, s_aux=module.sinks)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - expected).abs().max() <= (theirs.float() - expected).abs().max()


def causal_mask(t: int, window: int | None, before: int = 0, first: int = 0) -> torch.Tensor:
    """An additive [1, 1, t, before + t] mask for the last t of before + t positions: causal, inside `window`, no
    key before `first` (a row's left padding)."""
    query, key = torch.arange(before, before + t)[:, None], torch.arange(before + t)[None]
    visible = (key <= query) & ((query - key < window) if window else True) & (key >= first)
    return torch.where(visible, 0.0, MIN)[None, None]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("t, window, before", [(1, None, 0), (5, None, 0), (40, None, 3), (1, None, 7), (8, 8, 0),
                                               (5, 8, 2), (37, 8, 0), (40, 8, 9), (19, 5, 0), (1, 8, 20), (3, 16, 4)])
def test_unmasked_sinks_attend_causally_over_the_last_keys(t, window, before, device):
    """Without a mask the sink softmax is causal for queries at the last t positions of the keys (a prompt chunk
    after the earlier ones: its own keys and the earlier ones in two calls, merged by their log-sum-exps), inside
    the window where transformers passes one (by blocks where the window is the shorter), and gives gpt-oss's
    eager numbers with the explicit mask (CUDA: by the memory-efficient kernel in fp32)."""
    module, query, key, value, _ = attention_inputs(t=t, slots=before + t)
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, causal_mask(t, window, before),
                                                           scaling=0.25)
    query, key, value = (x.to(device) for x in (query, key, value))
    out, _ = grouped_query_attention(module, query, key, value, None, scaling=0.25, s_aux=module.sinks.to(device),
                                     sliding_window=window)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("window, before", [(None, 0), (None, 40), (16, 0), (16, 40)])
def test_unmasked_sinks_in_bf16_are_as_close_to_fp32_as_gpt_oss_eager_attention(window, before, device):
    """(CUDA: flash kernels without a window, the memory-efficient one by blocks with it.)"""
    module, query, key, value, _ = attention_inputs(heads=16, kv_heads=2, t=72, slots=before + 72, d=64)
    mask = causal_mask(72, window, before)
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=0.125)
    bf16 = [x.bfloat16() for x in (query, key, value, mask)]
    module.sinks = module.sinks.bfloat16()
    theirs, _ = modeling_gpt_oss.eager_attention_forward(module, *bf16, scaling=0.125)
    ours, _ = grouped_query_attention(module, *(x.to(device) for x in bf16[:3]), None, scaling=0.125,
                                      s_aux=module.sinks.to(device), sliding_window=window)
    assert ours.dtype == torch.bfloat16
    assert (ours.float().cpu() - expected).abs().max() <= (theirs.float() - expected).abs().max()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("sinks, window, before", [(True, None, 0), (True, None, 5), (True, 4, 0), (True, 4, 6),
                                                    (False, None, 0)])
def test_row_starts_attend_each_row_from_its_first_real_key(sinks, window, before, device):
    """A left-padded prefill's `row_starts` in place of a mask: each row causally over its keys from its first real
    one (a chunk's queries after earlier keys too, inside the window transformers passes a sliding sink layer), the
    numbers of gpt-oss's eager attention / transformers' SDPA with the explicit mask; padding queries get zeros."""
    t, firsts = 12, [0, 3, before + 7]  # the last row's padding reaches into the chunk's queries
    rows = [attention_inputs(t=t, slots=before + t, seed=seed) for seed in range(3)]
    module = rows[0][0]
    query, key, value = (torch.cat([row[i] for row in rows]) for i in (1, 2, 3))
    out, _ = grouped_query_attention(module, *(x.to(device) for x in (query, key, value)), row_starts(firsts),
                                     scaling=0.25, s_aux=module.sinks.to(device) if sinks else None,
                                     sliding_window=window)
    out = out.cpu()
    for row, first in enumerate(firsts):
        args = (module, query[row:row + 1], key[row:row + 1], value[row:row + 1], causal_mask(t, window, before, first))
        reference = modeling_gpt_oss.eager_attention_forward if sinks else sdpa_attention.sdpa_attention_forward
        expected, _ = reference(*args, scaling=0.25)
        real = max(first - before, 0)
        torch.testing.assert_close(out[row, real:], expected[0, real:], rtol=1e-5, atol=1e-5)
        assert not out[row, :real].any()


def test_long_prefills_and_unmasked_calls_take_transformers_sdpa(monkeypatch):
    """A folded mask grows by groups x t x slots: past the key/value copies it saves, transformers' path runs."""
    calls = []
    monkeypatch.setattr("dflash_compile.attention.sdpa_attention_forward",
                        lambda *args, **kwargs: calls.append(args[1].shape[2]) or (None, None))
    module, query, key, value, mask = attention_inputs(heads=4, kv_heads=1, t=40, slots=64, d=4)
    grouped_query_attention(module, query, key, value, mask)  # 4 x 40 rows > 2 x 4 heads x 4
    grouped_query_attention(module, query, key, value, None)
    module, query, key, value, mask = attention_inputs(heads=4, kv_heads=1, t=8, slots=64, d=4)
    grouped_query_attention(module, query, key, value, mask)  # 32 rows: folded
    assert calls == [40, 40]


@pytest.mark.parametrize("t, mask_rows", [(64, 4 * 64), (65, 65)])
def test_long_sink_calls_keep_one_mask_row_per_token(monkeypatch, t, mask_rows):
    """Past `folding_pays` the sink path repeats keys and values per query head instead of its mask per group: SDPA
    gets one mask row per token, broadcast over the heads."""
    sdpa, masks = torch.nn.functional.scaled_dot_product_attention, []

    def recording_sdpa(*args, attn_mask, **kwargs):
        masks.append(attn_mask.shape)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    module, query, key, value, mask = attention_inputs(t=t)  # 8 heads over 2: folding pays up to 64 tokens
    grouped_query_attention(module, query, key, value, mask, scaling=0.25, s_aux=module.sinks)
    assert masks[0][1:3] == (1, mask_rows)


@pytest.mark.parametrize("family, implementation, replaced", [
    ("qwen3_moe", "sdpa", True), ("qwen3_moe", "eager", False), ("gpt_oss", "eager", True)])
def test_the_switch_covers_what_it_reproduces_and_restores_the_users_choice(tiny, family, implementation, replaced):
    model = tiny(family)
    model.set_attn_implementation(implementation)
    with pytest.raises(RuntimeError, match="inside"):
        with grouped_attention(model):
            assert model.config._attn_implementation == (NAME if replaced else implementation)
            raise RuntimeError("inside")
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("family, module", [("qwen3_moe", sdpa_attention), ("gpt_oss", modeling_gpt_oss)])
def test_the_decoder_never_repeats_keys_and_values(tiny, family, module, monkeypatch):
    model = tiny(family)
    ids = torch.randint(3, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=12)
    fast = dflash_compile.optimize(model, compile=False)

    def refuse(*args):
        raise AssertionError("repeat_kv copied the keys and values")

    monkeypatch.setattr(module, "repeat_kv", refuse)
    assert torch.equal(fast.generate(ids, max_new_tokens=12), expected)


def latent_layer(tiny, family):
    """A latent-attention layer of a tiny model, its cached latents (rotary key [1, 1, s, rope], latent
    [1, 1, s, r]), queries of t tokens and a mask over the slots."""
    layer = tiny(family).model.layers[1].self_attn
    generator = torch.Generator().manual_seed(0)
    t, slots = 3, 20
    query = torch.randn(1, layer.num_heads, t, layer.qk_head_dim, generator=generator)
    rotary_key = torch.randn(1, 1, slots, layer.qk_rope_head_dim, generator=generator)
    latent = torch.randn(1, 1, slots, layer.kv_lora_rank, generator=generator)
    visible = torch.arange(slots) <= slots - t + torch.arange(t)[:, None]
    return layer, query, rotary_key, latent, torch.where(visible, 0.0, MIN)[None, None]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "hy_v4"])
def test_absorbed_latent_attention_is_attention_over_the_expanded_cache(tiny, family, device):
    """The queries moved into the latent space and the output back give what transformers computes over the keys
    and values it expands from the latents (`expand_kv` through kv_b_proj): fp32 on a CPU, bf16 on CUDA. HY V4's
    layers have sinks (here of random logits)."""
    from dflash_compile.attention import absorbed_attention, folded_attention

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layer, *inputs = latent_layer(tiny, family)
    layer = layer.to(device, dtype)
    query, rotary_key, latent, mask = (x.to(device, dtype).clamp(min=torch.finfo(dtype).min) for x in inputs)
    sinks = None
    if hasattr(layer, "sinks"):
        sinks = torch.randn(layer.num_heads, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        key, value = layer.expand_kv(latent, rotary_key)
        expected = folded_attention(query, key, value, mask, sinks, layer.scaling)
        out = absorbed_attention(layer, query, rotary_key, latent, mask, layer.scaling, sinks)
    assert out.shape == expected.shape == (1, 3, layer.num_heads, layer.v_head_dim) and out.dtype == dtype
    tolerance = 1e-5 if device == "cpu" else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_latent_steps_never_expand_the_cache(tiny, family, random_drafter, monkeypatch):
    """DeepSeek-V3's and GLM-4.7-Flash's decode and verify steps, and a short prefill under a mask, attend in the
    latent space: kv_b_proj never runs over the cache. An unpadded prompt's prefill (causal by flag, no mask)
    expands, once a layer. The same tokens as `model.generate`; the layers' own `expand_kv` back afterwards."""
    model = tiny(family)
    layer_class = type(model.model.layers[0].self_attn)
    expand_kv, expanded = layer_class.expand_kv, []
    monkeypatch.setattr(layer_class, "expand_kv", lambda layer, kv_nope, k_rot: expanded.append(kv_nope.shape[2])
                        or expand_kv(layer, kv_nope, k_rot))
    fast = dflash_compile.optimize(model, random_drafter(model), compile=False)
    ids = torch.randint(3, 127, (2, 9), generator=torch.Generator().manual_seed(0))
    for mask, expansions in ((torch.ones_like(ids).index_fill(1, torch.arange(3), 0), []),
                             (None, [9] * model.config.num_hidden_layers)):
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
        expanded.clear()
        assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=10), expected)
        assert expanded == expansions
    assert "expand_kv" not in vars(model.model.layers[0].self_attn)


@pytest.fixture
def decode_kernel_calls(monkeypatch):
    """The folded row counts of the decode kernel's calls, as they happen."""
    from dflash_compile.kernels import decode_attention

    calls = []
    kernel_call = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention",
                        lambda folded, *args: calls.append(folded.shape[2]) or kernel_call(folded, *args))
    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode kernel runs on CUDA")
@pytest.mark.parametrize("t, kernel", [(1, True), (16, True), (17, False)])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_few_new_tokens_take_the_decode_kernel_on_cuda(decode_kernel_calls, t, kernel, sinks):
    """Up to DECODE_KERNEL_MAX_ROWS folded query rows (16 tokens of 8 query heads per key/value head) run the
    Triton kernel of `dflash::decode_attention`; more run torch's math. Both give transformers' numbers."""
    module, query, key, value, mask = attention_inputs(heads=16, kv_heads=2, t=t, slots=64)
    if sinks:
        expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    else:
        expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    bf16_mask = mask.clamp(min=torch.finfo(torch.bfloat16).min)  # fp32's finfo.min is -inf in bf16
    on_gpu = [x.cuda().bfloat16() for x in (query, key, value, bf16_mask, module.sinks)]
    out, _ = grouped_query_attention(module, *on_gpu[:4], scaling=0.25, s_aux=on_gpu[4] if sinks else None)
    assert decode_kernel_calls == ([8 * t] if kernel else [])
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode kernel runs on CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fp16_decoding_with_the_decode_kernel_matches_generate(tiny, family, random_drafter, decode_kernel_calls):
    """A half-precision model on CUDA decodes and verifies through the decode kernel (inside the compiled steps'
    CUDA graphs) and keeps `model.generate`'s tokens. fp16, not bf16: the tiny gpt_oss in bf16 ties two logits
    exactly at its 10th new token for this prompt, so any other rounding (torch's math in the decoder too, on the
    CPU as well) may pick the other token (`python3 bench/tiny_identity.py`)."""
    model = tiny(family).cuda().half()
    ids = torch.randint(3, 127, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=12)
    fast = dflash_compile.optimize(model, random_drafter(model))
    assert torch.equal(fast.generate(ids, max_new_tokens=12), expected)
    assert decode_kernel_calls
