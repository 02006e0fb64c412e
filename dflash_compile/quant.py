"""Reference quantizers and dequantizers for the checkpoint formats dflash-compile keeps packed (FORMATS.md).

MXFP4 (OCP microscaling, gpt-oss): E2M1 codes, two per byte (low nibble = even element), one E8M0 scale per 32
elements along the last axis: value = 2^(scale - 127) * e2m1.
FP8 block-scaled (DeepSeek-V3 style): float8_e4m3fn weights [N, K] with one fp32 `weight_scale_inv` per
128 x 128 block (the last block row / column may be partial): value = q * scale_inv.

These are the pure-PyTorch definitions the fused kernels are tested against.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2
E4M3_MAX = 448.0


def _e2m1_byte_table() -> torch.Tensor:
    """The two values of every byte of packed codes, [256, 2] fp32: the low nibble's first."""
    magnitudes = torch.tensor(E2M1_VALUES)
    values = torch.cat([magnitudes, -magnitudes])  # codes 0x0-0x7, then the same negated
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=-1)


_E2M1_PAIRS = _e2m1_byte_table()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32]. A 0xFF scale is NaN. Each byte's pair
    of values from a 256-entry table (int32 indices), times its group's 2^(e - 127) (exact: a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: expected "
                         f"blocks [..., G, {MXFP4_GROUP // 2}] and scales [..., G]")
    pairs = _E2M1_PAIRS.to(blocks.device).index_select(0, blocks.flatten().int()).view(*blocks.shape, 2)
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.float32) - 127)
    values = pairs.mul_(torch.where(scales == 0xFF, torch.nan, scale)[..., None, None])
    return values.flatten(-3).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    Scale: 2^(floor(log2(amax)) - 2), the OCP choice (the group's largest magnitude lands in [4, 8), saturating to
    6). Elements: the nearest E2M1 value, ties to the even code."""
    check_mxfp4_groups(x.shape[-1])
    groups = x.contiguous().float().reshape(*x.shape[:-1], -1, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    _check_finite(amax, "MXFP4")
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_MAX_EXPONENT, torch.zeros_like(amax))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    codes = _nearest_e2m1_code(scaled)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def check_mxfp4_groups(size: int, where: str = "") -> None:
    """Refuse a last dimension MXFP4's groups of 32 do not divide (`where`: what holds it, for the message)."""
    if size % MXFP4_GROUP:
        raise ValueError(f"{where}MXFP4 groups of {MXFP4_GROUP} need the last dimension divisible by {MXFP4_GROUP}, "
                         f"got {size}")


def _check_finite(amax: torch.Tensor, format: str) -> None:
    """Refuse a weight whose blocks' largest magnitudes (`amax`) hold NaN or inf: no scale represents them."""
    if not torch.isfinite(amax).all():
        raise ValueError(f"the weight holds NaN or infinite values, which {format} cannot represent: check the "
                         "model's weights before quantizing")


def _e2m1_code_table() -> torch.Tensor:
    """The E2M1 code (sign in bit 3) nearest each magnitude, by quarters: entry 2i for i/4 itself, 2i + 1 for the
    open interval (i/4, (i + 1)/4), i up to 31 (from 7.75 on everything saturates to 6); then entries 64 on the same
    for negative values (-0 written as +0). E2M1's midpoints are all multiples of 1/4, so no open interval holds
    one, and a value on one takes the even code."""
    codes = []
    for quarter in range(32):
        for point in (quarter / 4, quarter / 4 + 1 / 8):  # exact in binary: so are the distances
            codes.append(min(range(len(E2M1_VALUES)), key=lambda code: (abs(point - E2M1_VALUES[code]), code % 2)))
    magnitudes = torch.tensor(codes, dtype=torch.uint8)
    return torch.cat([magnitudes, torch.where(magnitudes > 0, magnitudes | 8, magnitudes)])


_E2M1_CODES = _e2m1_code_table()


def _nearest_e2m1_code(scaled: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (uint8, sign in bit 3) nearest each finite value, ties to the even code, magnitudes above 6
    saturating to 6, -0 written as +0: `_E2M1_CODES` at the value's quarter, whether it lies past it and its sign.
    A few elementwise passes and one gather: 2.7x faster on the CPU than comparing with the midpoints."""
    quarters = scaled.abs().mul_(4)
    whole = quarters.floor().clamp_(max=31)
    index = whole.mul(2).add_(quarters.ne_(whole)).add_((scaled < 0) * 64.0)
    return _E2M1_CODES.to(scaled.device)[index.to(torch.int64)]


def _block_grid(weight_shape, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1]))


def _padded_blocks(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`weight` [N, K] as fp32 zero-padded to whole blocks, viewed [N/bn, bn, K/bk, bk]: one copy, over which
    per-block values broadcast (partial last blocks included) and reductions run per block."""
    rows, cols = _block_grid(weight.shape, block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    return padded.view(rows, block[0], cols, block[1])


def _unpadded(blocks: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """`_padded_blocks`' [N, K] again, in `dtype`, contiguous."""
    rows, bn, cols, bk = blocks.shape
    return blocks.view(rows * bn, cols * bk)[: shape[0], : shape[1]].to(dtype).contiguous()


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8 weight [N, K] and fp32 (or e8m0) scale_inv [ceil(N/bn), ceil(K/bk)] -> weight * scale_inv."""
    expected = _block_grid(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 weight {list(weight.shape)} with block {list(block)} needs a scale grid "
                         f"{list(expected)}, got weight_scale_inv {list(scale_inv.shape)}")
    blocks = _padded_blocks(weight, block).mul_(scale_inv.float()[:, None, :, None])
    return _unpadded(blocks, weight.shape, dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                       power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv grid): scale = block amax / 448, values saturate. With
    `power_of_two` the scale is rounded up to a power of two (`scale_fmt` "ue8m0": DeepSeek-V4's release keeps it as
    a float8_e8m0fnu byte)."""
    blocks = _padded_blocks(weight, block)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())  # no |weight| copy
    _check_finite(amax, "FP8")
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    blocks.div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return _unpadded(blocks, weight.shape, torch.float8_e4m3fn), scale
