"""Expert blobs copied host -> slot pool by the GPU's own loads (pinned host memory is addressable from kernels),
from copy lists that live on the device: the device-managed expert cache (`dflash_compile.slot_table`) decides the
copies on the device, so no host read has to come first and the copy can sit inside a CUDA graph. The copy
engine would need the host to issue each cudaMemcpy.

The work is the listed blobs cut into chunks of BLOCK 4-byte words; a fixed number of programs (PROGRAMS) walk
it, each taking every PROGRAMS-th chunk, and skip chunks of rows whose `valid` is 0 (the list has a fixed length, so
the grid does not depend on how many copies a step needs). Few programs, not one per chunk: a grid of thousands of
programs holds every SM until its last ones are dispatched, and the compute stream's kernels, which the copy is meant
to run beside, wait behind it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words (16 KiB) per chunk
PROGRAMS = 64  # programs per copy: enough loads in flight for PCIe, SMs left for the compute stream (H200,
# Qwen3-30B-A3B shape: 64 vs 32 programs 1.24x vs 1.30x of the PCIe floor at 25% resident, equal at 50%)


@triton.jit
def _copy_blobs_kernel(host, pool, experts, slots, valid, words, chunks, items, BLOCK: tl.constexpr):
    for item in range(tl.program_id(0), items, tl.num_programs(0)):  # item = row * chunks + chunk
        row = item // chunks
        if tl.load(valid + row) != 0:
            expert = tl.load(experts + row).to(tl.int64)
            slot = tl.load(slots + row).to(tl.int64)
            offsets = (item % chunks) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < words
            words_in = tl.load(host + expert * words + offsets, mask=inside)
            tl.store(pool + slot * words + offsets, words_in, mask=inside)


def copy_blobs(host: torch.Tensor, pool: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
               valid: torch.Tensor, programs: int | None = None) -> None:
    """pool[slots[i]] = host[experts[i]] for every i with valid[i] (host [E, bytes] pinned uint8 blobs, pool
    [S, bytes] on the device, the lists [N] on the device), by `programs` programs (default PROGRAMS)."""
    if host.shape[1] != pool.shape[1] or host.shape[1] % 4:
        raise ValueError(f"blobs of {host.shape[1]} bytes into slots of {pool.shape[1]}: expected equal sizes, a "
                         "multiple of 4 bytes")
    words = host.shape[1] // 4
    chunks = triton.cdiv(words, BLOCK)
    items = experts.numel() * chunks
    grid = (max(1, min(programs or PROGRAMS, items)),)
    _copy_blobs_kernel[grid](host.view(torch.int32), pool.view(torch.int32), experts, slots, valid, words, chunks,
                             items, BLOCK=BLOCK)
