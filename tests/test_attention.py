"""Grouped-query attention on the cache's keys and values as they are: the numbers of transformers' own attention
functions, no `repeat_kv` copies inside the decoder's forwards, the user's implementation back afterwards."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.models.gpt_oss import modeling_gpt_oss

import dflash_compile
from dflash_compile.attention import NAME, grouped_attention, grouped_query_attention

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


@pytest.mark.parametrize("t", [1, 5])
def test_sink_softmax_is_gpt_oss_eager_attention(t):
    module, query, key, value, mask = attention_inputs(t=t)
    expected, _ = modeling_gpt_oss.eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    out, _ = grouped_query_attention(module, query, key, value, mask, scaling=0.25, s_aux=module.sinks)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


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
