"""The CUDA kernel of `dflash::decode_attention` (kernels/decode_attention.py) against torch's math
(`attention.folded_attention`): fp32 in Triton's interpreter on a CPU, bf16 on a GPU."""

import pytest
import torch

import dflash_compile
from dflash_compile.attention import folded_attention
from dflash_compile.cache import additive_mask
from dflash_compile.kernels import arrivals
from dflash_compile.kernels.decode_attention import _splits, grouped_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOLERANCE = 2e-2 if DEVICE == "cuda" else 1e-5


def _inputs(heads, kv_heads, t, slots, d=16, sinks=False, batch=2, seed=0):
    """Queries, a cache viewed from a larger one (strided, as the cache's layers are), a mask showing each row a
    prefix of the slots plus the new tokens causally (row 1, if any, left-padded: its first query sees nothing),
    sinks."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, t, heads, d, generator=generator).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, slots + 5, d, generator=generator)[:, :, :slots] for _ in range(2))
    query_slot = slots - t + torch.arange(t)[:, None]
    visible = (torch.arange(slots) <= query_slot).expand(batch, t, slots).clone()
    visible[1:, 0] = False  # a padding query
    sink_logits = torch.randn(heads, generator=generator) if sinks else None
    tensors = [x if x is None else x.to(DEVICE, DTYPE) for x in (query, key, value, sink_logits)]
    return *tensors[:3], additive_mask(visible.to(DEVICE), DTYPE), tensors[3]


def _kernel(query, key, value, mask, sinks, seen=None, **tiles):
    return grouped_decode_attention(query, key, value, mask, sinks, 0.25, seen, **tiles)


@pytest.mark.parametrize("merge_in_launch", [True, False])
@pytest.mark.parametrize("t, slots, splits", [(1, 100, 1), (3, 100, 3), (3, 37, None), (4, 40, 2)])
@pytest.mark.parametrize("heads, kv_heads, sinks", [(8, 2, True), (4, 4, False), (8, 1, False)])
def test_matches_torch_math(monkeypatch, heads, kv_heads, sinks, t, slots, splits, merge_in_launch):
    """One or several shares of the slots (the last one partial), merged by the last program to arrive or by a
    second launch (no arrival counts), with and without sinks; the padding query as the kernel promises it; the
    arrival counts left zeroed."""
    if not merge_in_launch:
        monkeypatch.setattr(arrivals, "SIZE", 0)
    query, key, value, mask, sink_logits = _inputs(heads, kv_heads, t, slots, sinks=sinks)
    out = _kernel(query, key, value, mask, sink_logits, splits=splits, block_s=16)
    expected = folded_attention(query, key, value, mask, sink_logits, 0.25)
    # Row 1's padding query sees no slot, and torch's backends disagree there (its math a uniform average, CUDA's
    # SDPA kernels zeros): the kernel gives torch's math, finite either way, as its rows feed the next layer.
    expected[1, 0] = 0 if sinks else value[1].float().mean(1).repeat_interleave(heads // kv_heads, 0)
    assert out.shape == expected.shape == (2, t, heads, 16) and out.dtype == DTYPE
    torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)
    if merge_in_launch:
        assert arrivals._COUNTS[key.device].count_nonzero() == 0


@pytest.mark.parametrize("merge_in_launch", [True, False])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("t", [3, 4])
@pytest.mark.parametrize("block_r", [16, 32])
def test_rows_over_several_programs(monkeypatch, sinks, t, merge_in_launch, block_r):
    """A head's 24 or 32 folded rows in programs of 16 (the default; the last one partial for 24), each merged on
    its own, sinks found by the rows' global index; or all in one program of 32."""
    if not merge_in_launch:
        monkeypatch.setattr(arrivals, "SIZE", 0)
    query, key, value, mask, sink_logits = _inputs(8, 1, t, 40, sinks=sinks)
    out = _kernel(query, key, value, mask, sink_logits, splits=2, block_s=16, block_r=block_r)
    expected = folded_attention(query, key, value, mask, sink_logits, 0.25)
    expected[1, 0] = 0 if sinks else value[1].float().mean(1)  # the padding query, as in test_matches_torch_math
    torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("seen, splits", [(37, 4), (37, 1), (64, 3), (5, 4)])
def test_slots_from_seen_on_are_never_read(sinks, seen, splits):
    """With `seen` the shares split the slots before it, rounded up to 16 (some shares left with nothing: 16 slots
    over 4 shares of 16), and never read the rest: NaN keys and values there, hidden by the mask from every row,
    leave the output as torch's math over the slots read (the padding query's uniform average too)."""
    read = -(-seen // 16) * 16
    query, key, value, mask, sink_logits = _inputs(8, 2, 3, read, sinks=sinks)
    mask[..., seen:] = torch.finfo(DTYPE).min
    expected = folded_attention(query, key, value, mask, sink_logits, 0.25)
    expected[1, 0] = 0 if sinks else value[1].float().mean(1).repeat_interleave(4, 0)  # as in test_matches_torch_math
    past = 100 - read
    key, value = (torch.nn.functional.pad(x, (0, 0, 0, past), value=float("nan")) for x in (key, value))
    mask = torch.nn.functional.pad(mask, (0, past), value=torch.finfo(DTYPE).min)
    out = _kernel(query, key, value, mask, sink_logits, seen=torch.tensor(seen, device=DEVICE), splits=splits,
                  block_s=16)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_rows_per_program_must_be_a_power_of_two_from_16():
    query, key, value, mask, _ = _inputs(8, 1, 4, 40)
    with pytest.raises(ValueError, match="block_r must be a power of two from 16, got 24"):
        _kernel(query, key, value, mask, None, block_r=24)


def test_shares_are_capped_by_the_partials_one_program_merges():
    """On an H200 (264 programs), a one-token step over 8192 slots: gpt-oss-20b's and Qwen3-30B-A3B's groups of rows
    split the slots to fill the GPU; Qwen3.5-MoE's two groups of D 256 take 64 shares, not the 128 that would fill
    it (whose launch did not finish compiling and running in 100 s)."""
    assert _splits(8192, 64, 8, 64, programs=264) == 33
    assert _splits(8192, 64, 4, 128, programs=264) == 66
    assert _splits(8192, 64, 2, 256, programs=264) == 64


@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 and the default tiles and shares on a GPU")
@pytest.mark.parametrize("heads, kv_heads, d, sinks", [(64, 8, 64, True), (32, 4, 128, False), (16, 2, 256, False)])
@pytest.mark.parametrize("t, slots", [(1, 1000), (16, 1000), (1, 8192)])
def test_model_shapes_on_cuda(heads, kv_heads, d, sinks, t, slots):
    """gpt-oss-20b's, Qwen3-30B-A3B's and Qwen3.5-MoE's heads, one token and a verify block of 16."""
    query, key, value, mask, sink_logits = _inputs(heads, kv_heads, t, slots, d=d, sinks=sinks, batch=1)
    out = _kernel(query, key, value, mask, sink_logits)
    expected = folded_attention(query.float(), key.float(), value.float(), mask.float(),
                                None if sink_logits is None else sink_logits.float(), 0.25)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU models run the kernel in Triton's interpreter")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
def test_the_decoder_through_the_kernel_keeps_generates_tokens(tiny, random_drafter, family, monkeypatch):
    """The kernel inside the real decoder (fp32, interpreter) of each kind of attention that takes it (grouped-query,
    gpt-oss's sliding-window rings and sinks, Qwen3.5's between linear-attention layers; latent attention's steps
    attend in the latent space, `attention.absorbed_attention`): the cache's masks, decode steps and verify
    blocks, a left-padded batch, each step's slots from `TargetCache.seen_slots` on left unread -- the same tokens
    as `model.generate`."""
    from dflash_compile import attention, ops
    from dflash_compile.kernels import decode_attention

    calls, unread = [], []

    def takes(query, key, value, mask):
        fits = attention.decode_kernel_shapes(query, key, value, mask)
        calls.append(fits)
        return fits

    def kernel(query, key, value, mask, sinks, scaling, seen):  # None in the prefill: its keys end where it sees
        unread.append(0 if seen is None else key.shape[2] - seen.item())
        return grouped_decode_attention(query, key, value, mask, sinks, scaling, seen)

    monkeypatch.setattr(attention, "decode_kernel_takes", takes)
    monkeypatch.setattr(ops, "decode_kernel_takes", takes)
    monkeypatch.setattr(decode_attention, "grouped_decode_attention", kernel)
    model = tiny(family)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 127, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    fast = dflash_compile.optimize(model, random_drafter(model), compile=False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=10), expected)
    assert any(calls) and max(unread) > 0
