"""What limits one token's MXFP4 gate/up launch: the bytes or the work? (H200)

    python bench/read_order.py

A decode step's gate/up launch (gpt-oss shape: 4 experts x 5760 rows x 1440 bytes, 33.2 MB of codes) has each
program stream the rows of one column tile, one 128-byte K step of every row at a time, rows 1440 bytes apart. This
times the fused launch next to kernels that read the same bytes with no math (moe_kernels' `_read_tile`), in that
order ("row-major") and with each tile's bytes stored K-step-major, one contiguous span per program and step
("tile-major"), and torch.sum over as many bytes; first rotated over 8 layers (from DRAM), then one layer of 1, 2
and 4 experts replayed (served by L2). Session 16 (docs/benchmarks.md): the reads stream 3.2-3.5 TB/s (75-82% of
copy) in either order against the fused launch's 1.8 TB/s, and the fused launch takes about as long from L2 as from DRAM
(17.6 vs 18.3 us): its time is the SMs' (ALU-bound decode), not the memory's, and no load-time layout would help.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels.moe import PAIR_PER_BLOCK, Blocks, _launch, tiles_for  # noqa: E402
from dflash_compile.packed import PackedWeight  # noqa: E402
from moe_kernels import _read_tile, graph_time_us  # noqa: E402  (bench/, the script's own folder)


def gate_up_us(buffers, experts: int, rows: int, row_bytes: int) -> float:
    """The fused kernel's gate/up launch for one token over the buffers' bytes as MXFP4 experts."""
    hidden = 2 * row_bytes
    weights = [PackedWeight("mxfp4", b.view(torch.uint8).view(experts, rows, hidden // 32, 16),
                            torch.full((experts, rows, hidden // 32), 120, dtype=torch.uint8, device="cuda"),
                            torch.zeros(experts, rows, dtype=torch.bfloat16, device="cuda")) for b in buffers]
    x = torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda")
    blocks = Blocks(PAIR_PER_BLOCK, experts, block_expert=torch.arange(experts, dtype=torch.int32, device="cuda"))
    settings = tiles_for("mxfp4", {}, 1, "tma")  # as `fused_moe` picks them on the H200 (gate/up's)
    for one_token_only in ("split_k", "down_launch"):  # a single gate/up launch, unsplit
        settings.pop(one_token_only)
    launch = lambda w: _launch(x, w, blocks, None, experts, rows // 2, experts, gated=True,  # noqa: E731
                               interleaved=True, activation="clamped_swiglu", alpha=1.702, limit=7.0,
                               compute_fp32=False, **settings)
    return graph_time_us([lambda w=w: launch(w) for w in weights])


def report(experts: int, rows: int, row_bytes: int, layers: int, sweep: bool) -> None:
    """Times the reads and the fused gate/up launch over `layers` buffers of `experts` experts, rotated."""
    buffers = [torch.randint(0, 2**31, (experts * rows * row_bytes // 8,), dtype=torch.int64, device="cuda")
               for _ in range(layers)]
    nbytes = experts * rows * row_bytes
    print(f"{experts} experts, {nbytes / 1e6:.1f} MB per layer, {layers} layers rotated")
    out = torch.empty(experts * rows, dtype=torch.int64, device="cuda")
    total = graph_time_us([lambda b=b: b.sum() for b in buffers])
    print(f"  torch.sum: {total:.1f} us ({nbytes / total / 1e3:.0f} GB/s)")
    fused = gate_up_us(buffers, experts, rows, row_bytes)
    print(f"  the fused kernel's one-token gate/up launch: {fused:.1f} us ({nbytes / fused / 1e3:.0f} GB/s of codes; "
          "plus their scales and biases)")
    for tile_rows, num_warps, num_stages in itertools.product((16, 32), (2, 4), (1, 2, 3)) if sweep else [(32, 2, 3)]:
        times, xors = {}, {}
        for tile_major in (False, True):
            grid = (experts, rows // tile_rows)
            read = lambda b, major=tile_major: _read_tile[grid](  # noqa: E731
                b, out, ROW_BYTES=row_bytes, TILE_ROWS=tile_rows, STEP=128, TILE_MAJOR=major,
                NUM_STAGES=num_stages, num_warps=num_warps)
            read(buffers[0])
            xors[tile_major] = out[:grid[0] * grid[1]].clone()
            times[tile_major] = graph_time_us([lambda b=b: read(b) for b in buffers])
        assert torch.equal(xors[False], xors[True]), "the two orders must read the same bytes of each tile"
        print(f"  read, tiles of {tile_rows} rows, {num_warps} warps, {num_stages} stages: row-major "
              f"{times[False]:.1f} us ({nbytes / times[False] / 1e3:.0f} GB/s), tile-major {times[True]:.1f} us "
              f"({nbytes / times[True] / 1e3:.0f} GB/s)", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name())
    report(experts=4, rows=5760, row_bytes=1440, layers=8, sweep=True)  # from DRAM
    for experts in (1, 2, 4):  # one layer, served by L2 after the first read (4 experts: 33 MB of 50)
        report(experts=experts, rows=5760, row_bytes=1440, layers=1, sweep=False)


if __name__ == "__main__":
    main()
