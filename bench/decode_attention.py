"""A probe: one decode / verify attention layer as one Triton launch over the cache's slots (split across programs,
flash-decoding style) plus a small merging launch, against what the compiled step runs today
(`dflash_compile.attention.grouped_query_attention` under torch.compile: a QK^T GEMM, a softmax kernel and a PV GEMM
per layer, ~8 us a layer of gpt-oss-20b at a 512-token context in session 32's profile).

    python bench/decode_attention.py                      # H200: gpt-oss-20b (sinks) and Qwen3-30B-A3B layers
    python bench/decode_attention.py --slots 512 4096 --tokens 1 16
    TRITON_INTERPRET=1 python bench/decode_attention.py --check   # CPU: fp32 numerics against the reference

Queries are folded by group as `grouped_query_attention` folds them ([b, kv heads, groups * t, d]); each program
takes one (row, key/value head) and a share of the slots, with an online softmax in fp32 (the additive mask read as
given, gpt-oss's sinks joining each query's softmax in the merge); the merge runs as a second launch, or inside
the first by the last program of each head to arrive (an acquire-release count, as the fused MoE kernel sums its
pairs), timed both ways. Not wired into the package: if it wins, it becomes a kernel under dflash_compile/kernels
and `grouped_query_attention`'s CUDA path.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from dflash_compile.attention import _fold, _unfold, grouped_query_attention

SHAPES = {"gpt-oss-20b": (64, 8, 64, True), "qwen3-30b-a3b": (32, 4, 128, False)}  # heads, kv heads, d, sinks


@triton.jit
def _split_kernel(q, k, v, mask, acc_out, stats_out, sinks, out, counts, scaling, R, T, S, CHUNK, GROUPS,
                  q_b, q_h, q_r, k_b, k_h, k_s, v_b, v_h, v_s, m_b, m_t, m_s,
                  KV_HEADS: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, MERGE_IN_LAUNCH: tl.constexpr):
    row_head, split = tl.program_id(0), tl.program_id(1)
    b, h = row_head // KV_HEADS, row_head % KV_HEADS
    rows, dims = tl.arange(0, BLOCK_R), tl.arange(0, D)
    row_ok = rows < R
    queries = tl.load(q + b * q_b + h * q_h + rows[:, None] * q_r + dims[None, :], mask=row_ok[:, None], other=0.0)
    largest = tl.full([BLOCK_R], -1e30, tl.float32)  # finite: a tile of padding slots (-inf) makes no NaN
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, S)
    for first in range(start, stop, BLOCK_S):
        slots = first + tl.arange(0, BLOCK_S)
        slot_ok = slots < stop
        keys = tl.load(k + b * k_b + h * k_h + slots[:, None] * k_s + dims[None, :], mask=slot_ok[:, None], other=0.0)
        scores = tl.dot(queries, tl.trans(keys)) * scaling
        bias = tl.load(mask + b * m_b + (rows % T)[:, None] * m_t + slots[None, :] * m_s,
                       mask=row_ok[:, None] & slot_ok[None, :], other=0.0)
        scores = tl.where(slot_ok[None, :], scores + bias.to(tl.float32), float("-inf"))
        new_largest = tl.maximum(largest, tl.max(scores, axis=1))
        shrink = tl.exp(largest - new_largest)
        p = tl.exp(scores - new_largest[:, None])
        total = total * shrink + tl.sum(p, axis=1)
        values = tl.load(v + b * v_b + h * v_h + slots[:, None] * v_s + dims[None, :], mask=slot_ok[:, None],
                         other=0.0)
        acc = acc * shrink[:, None] + tl.dot(p.to(values.dtype), values)
        largest = new_largest
    part = row_head * SPLITS + split
    tl.store(acc_out + (part * BLOCK_R + rows[:, None]) * D + dims[None, :], acc)
    tl.store(stats_out + (part * 2) * BLOCK_R + rows, largest)
    tl.store(stats_out + (part * 2 + 1) * BLOCK_R + rows, total)
    if MERGE_IN_LAUNCH:  # the last of a head's programs to arrive merges (acquire-release orders the partials)
        tl.debug_barrier()
        arrived = tl.atomic_add(counts + row_head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            _merge(acc_out, stats_out, sinks, out, row_head, R, T, GROUPS, KV_HEADS, SPLITS, D, BLOCK_R, HAS_SINKS)
            tl.store(counts + row_head, 0)  # zero again for the next call


@triton.jit
def _merge_kernel(acc_in, stats_in, sinks, out, R, T, GROUPS, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    _merge(acc_in, stats_in, sinks, out, tl.program_id(0), R, T, GROUPS, KV_HEADS, SPLITS, D, BLOCK_R, HAS_SINKS)


@triton.jit
def _merge(acc_in, stats_in, sinks, out, row_head, R, T, GROUPS, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
           D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    """A head's output rows from its SPLITS partials (and its sinks' logits)."""
    rows, dims = tl.arange(0, BLOCK_R), tl.arange(0, D)
    largest = tl.full([BLOCK_R], -1e30, tl.float32)
    for split in tl.static_range(SPLITS):
        largest = tl.maximum(largest, tl.load(stats_in + ((row_head * SPLITS + split) * 2) * BLOCK_R + rows))
    if HAS_SINKS:
        sink = tl.load(sinks + (row_head % KV_HEADS) * GROUPS + rows // T, mask=rows < R, other=-1e30).to(tl.float32)
        largest = tl.maximum(largest, sink)
        total = tl.exp(sink - largest)
    else:
        total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for split in tl.static_range(SPLITS):
        part = row_head * SPLITS + split
        weight = tl.exp(tl.load(stats_in + (part * 2) * BLOCK_R + rows) - largest)
        total += weight * tl.load(stats_in + (part * 2 + 1) * BLOCK_R + rows)
        acc += weight[:, None] * tl.load(acc_in + (part * BLOCK_R + rows[:, None]) * D + dims[None, :])
    total = tl.where(total == 0, 1.0, total)  # a row seeing nothing (never a real query) gives zeros
    tl.store(out + (row_head * R + rows[:, None]) * D + dims[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
             mask=rows[:, None] < R)


_COUNTS: dict[torch.device, torch.Tensor] = {}  # zeroed arrival counts per device, left zeroed by every launch


def decode_attention(query, key, value, mask, scaling: float, sinks=None, splits: int | None = None,
                     block_s: int = 64, merge_in_launch: bool = False):
    """query [b, heads, t, d], key/value [b, kv heads, S, d] (any strides), additive mask [b, 1, t, S], sinks
    [heads] or None -> [b, t, heads, d], as `grouped_query_attention` returns it. `merge_in_launch`: the last
    program of each head merges its shares (one launch) instead of a second launch."""
    b, heads, t, d = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    folded = _fold(query, kv_heads).contiguous()
    rows = groups * t
    block_r = max(16, triton.next_power_of_2(rows))
    if splits is None:
        programs = 2 * (torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4)
        splits = max(1, min(triton.cdiv(slots, block_s), programs // (b * kv_heads)))
    chunk = triton.cdiv(triton.cdiv(slots, splits), block_s) * block_s
    splits = triton.cdiv(slots, chunk)
    acc = torch.empty(b * kv_heads, splits, block_r, d, device=query.device, dtype=torch.float32)
    stats = torch.empty(b * kv_heads, splits, 2, block_r, device=query.device, dtype=torch.float32)
    out = torch.empty(b, kv_heads, rows, d, device=query.device, dtype=query.dtype)
    counts = _COUNTS.setdefault(query.device, torch.zeros(1 << 12, dtype=torch.int32, device=query.device))
    assert b * kv_heads <= counts.numel(), "more (row, head) pairs than arrival counts"
    sinks_or_any = sinks if sinks is not None else acc  # an unread pointer without sinks
    _split_kernel[(b * kv_heads, splits)](
        folded, key, value, mask, acc, stats, sinks_or_any, out, counts, scaling, rows, t, slots, chunk, groups,
        folded.stride(0), folded.stride(1), folded.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        KV_HEADS=kv_heads, SPLITS=splits, D=d, BLOCK_R=block_r, BLOCK_S=block_s, HAS_SINKS=sinks is not None,
        MERGE_IN_LAUNCH=merge_in_launch,
        num_warps=8 if block_r * d >= 8192 else 4)  # a verify block's rows x head dim of fp32 accumulators
    if not merge_in_launch:
        _merge_kernel[(b * kv_heads,)](acc, stats, sinks_or_any, out, rows, t, groups, KV_HEADS=kv_heads,
                                       SPLITS=splits, D=d, BLOCK_R=block_r, HAS_SINKS=sinks is not None, num_warps=4)
    return _unfold(out, heads, t)


def inputs(shape: str, tokens: int, slots: int, device: str, dtype: torch.dtype, batch: int = 1):
    """Queries, the cache, a mask showing the first half of the slots plus the block causally, sinks."""
    heads, kv_heads, d, has_sinks = SHAPES[shape]
    query = torch.randn(batch, tokens, heads, d, device=device, dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, slots, d, device=device, dtype=dtype) for _ in range(2))
    visible = torch.arange(slots, device=device) <= slots // 2 + torch.arange(tokens, device=device)[:, None]
    mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None].expand(batch, 1, tokens, slots)
    sinks = torch.randn(heads, device=device, dtype=dtype) if has_sinks else None
    return query, key, value, mask.contiguous(), sinks


def reference(query, key, value, mask, scaling, sinks):
    module = type("Layer", (), {"num_key_value_groups": query.shape[1] // key.shape[1], "is_causal": True,
                                "training": False})()
    return grouped_query_attention(module, query, key, value, mask, scaling=scaling, s_aux=sinks)[0]


def check() -> None:
    """fp32 on the CPU (TRITON_INTERPRET=1): the probe against `grouped_query_attention`, both families' heads,
    1 and 3 tokens, two rows, slots not a multiple of the tile, one and several shares."""
    torch.manual_seed(0)
    for shape in SHAPES:
        for tokens, slots, splits in ((1, 100, 1), (3, 100, 3), (3, 37, None)):
            tensors = inputs(shape, tokens, slots, "cpu", torch.float32, batch=2)
            expected = reference(*tensors[:4], 0.125, tensors[4])
            for merge_in_launch in (False, True):
                actual = decode_attention(*tensors[:4], 0.125, tensors[4], splits=splits, block_s=16,
                                          merge_in_launch=merge_in_launch)
                error = (actual - expected).abs().max().item()
                print(f"{shape} tokens {tokens} slots {slots} splits {splits} merge in launch {merge_in_launch}: "
                      f"max difference {error:.1e}")
                assert error < 1e-4, error
    assert not _COUNTS[torch.device("cpu")].any()  # left zeroed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--slots", nargs="+", type=int, default=[512, 1024, 4096, 8192])
    parser.add_argument("--check", action="store_true", help="CPU numerics under TRITON_INTERPRET=1, no timing")
    args = parser.parse_args()
    if args.check:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run the check with TRITON_INTERPRET=1"
        return check()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| shape | tokens | slots | compiled grouped us | probe us | speed-up | merged in launch us | speed-up | "
          "max difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for tokens in args.tokens:
            for slots in args.slots:
                tensors = inputs(shape, tokens, slots, "cuda", torch.bfloat16)
                compiled = torch.compile(lambda: reference(*tensors[:4], 0.125, tensors[4]))
                probes = [lambda m=m: decode_attention(*tensors[:4], 0.125, tensors[4], merge_in_launch=m)
                          for m in (False, True)]
                times = [triton.testing.do_bench_cudagraph(side) * 1e3 for side in (compiled, *probes)]
                difference = max((compiled().float() - probe().float()).abs().max().item() for probe in probes)
                print(f"| {shape} | {tokens} | {slots} | {times[0]:.1f} | {times[1]:.1f} | "
                      f"{times[0] / times[1]:.2f}x | {times[2]:.1f} | {times[0] / times[2]:.2f}x | {difference:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()
