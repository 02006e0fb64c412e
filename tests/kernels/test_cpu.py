"""The C++ CPU kernel of `dflash::packed_moe` (csrc/moe_cpu.cpp) against reference dequantization + fp64 math."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_compile.expert_store import Gate, reference_packed, run_packed
from dflash_compile.kernels import cpu
from dflash_compile.packed import PackedWeight
from tests.kernels.test_moe import _experts, _routing, reference_moe

LAYOUTS = {  # experts, hidden, intermediate, top-k, tokens, interleaved, activation, bias
    "gpt_oss": (4, 2880, 32, 2, 3, True, "clamped_swiglu", True),  # K = 2880: not a multiple of 128
    "silu_concatenated": (3, 96, 160, 2, 5, False, "silu", False),
    "gelu_concatenated": (3, 96, 160, 2, 5, False, "gelu_tanh", False),  # Gemma 4
    "prefill": (3, 96, 64, 2, 60, True, "clamped_swiglu", True),  # ~40 pairs per expert: decoded blocks and a GEMM
}


def _packed_moe(x, index, weights, gate_up, down, interleaved, activation):
    return torch.ops.dflash.packed_moe(x, index, weights, gate_up.format, gate_up.data, gate_up.scales, gate_up.bias,
                                       down.data, down.scales, down.bias, interleaved, activation, 1.702, 7.0)


@pytest.mark.parametrize("activation", ["clamped_silu", "clamped_gate_silu", "softcapped_swiglu"])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_cpu_kernel_clamps_silu_as_step_3_7_and_hy_v4(activation, format):
    """Step 3.7's SiLU(gate) <= limit and HY V4's SiLU(gate <= limit), each times up clamped to [-limit, limit], and
    Inkling 2's softcapped SwiGLU (up's softcap the limit, the gate's 1.702), at a limit (0.5) that clips most values
    here."""
    gate_up, down = _experts(format, 3, 96, 160, False, device="cpu")
    index, weights = _routing(5, 3, 2)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, False, activation, limit=0.5)
    actual = torch.ops.dflash.packed_moe(x, index, weights, format, gate_up.data, gate_up.scales, None, down.data,
                                         down.scales, None, False, activation, 1.702, 0.5)
    assert (actual.double() - expected).norm() / expected.norm() <= 1e-5
    gate = Gate(False, activation, limit=0.5)
    torch.testing.assert_close(reference_packed(x, index, weights, gate_up, down, gate), actual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_cpu_kernel_runs_ungated_experts(format):
    """Nemotron-H's experts: up [E, I, H] alone, relu(up)^2, then down (with biases)."""
    up, down = _experts(format, 3, 96, 160, True, device="cpu", gated=False)
    index, weights = _routing(5, 3, 2)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, up, down, False, "relu2")
    actual = torch.ops.dflash.packed_moe(x, index, weights, format, up.data, up.scales, up.bias, down.data,
                                         down.scales, down.bias, False, "relu2", 1.702, 7.0)
    assert (actual.double() - expected).norm() / expected.norm() <= 1e-5
    gate = Gate(False, "relu2")
    torch.testing.assert_close(reference_packed(x, index, weights, up, down, gate), actual, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_registered_for_the_cpu_dispatch_key():
    assert cpu.load(), cpu.status()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dflash::packed_moe", "CPU")
    assert cpu.status() == "C++ CPU kernels loaded"


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cpu_kernel_matches_the_reference(format, layout):
    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = LAYOUTS[layout]
    gate_up, down = _experts(format, experts, hidden, inter, bias, device="cpu")
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, interleaved, activation)
    actual = _packed_moe(x, index, weights, gate_up, down, interleaved, activation)
    assert actual.dtype == x.dtype
    error = (actual.double() - expected).norm() / expected.norm()
    assert error <= 1e-4, f"relative error {error:.2e}"


def test_bf16_activations_and_bf16_dense_weights():
    gate_up, down = _experts("dense", 3, 64, 32, bias=True, device="cpu")
    gate_up, down = (PackedWeight("dense", w.data.bfloat16(), None, w.bias.bfloat16()) for w in (gate_up, down))
    index, weights = _routing(4, 3, 2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate = Gate(False, "silu")
    actual = run_packed(x, index, weights, gate_up, down, gate)
    expected = reference_packed(x, index, weights, gate_up, down, gate)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected.to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_strided_slot_pool_views():
    """Experts read through a pool with more bytes per slot than the weight (offload's blob views)."""
    gate_up, down = _experts("mxfp4", 3, 64, 32, bias=True, device="cpu")

    def pooled(weight: PackedWeight) -> PackedWeight:
        def widen(t):
            wide = torch.zeros(t.shape[0], t[0].numel() + 40, dtype=t.dtype)
            wide[:, :t[0].numel()] = t.reshape(t.shape[0], -1)
            return wide[:, :t[0].numel()].view(t.shape)

        return PackedWeight(weight.format, widen(weight.data), widen(weight.scales), widen(weight.bias))

    index, weights = _routing(4, 3, 2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    expected = _packed_moe(x, index, weights, gate_up, down, False, "silu")
    torch.testing.assert_close(_packed_moe(x, index, weights, pooled(gate_up), pooled(down), False, "silu"),
                               expected, atol=0, rtol=0)


def test_bad_input_is_named():
    gate_up, down = _experts("fp8_block", 2, 128, 64, bias=False, device="cpu")
    index, weights = _routing(1, 2, 1)
    x = torch.zeros(1, 128)
    with pytest.raises(RuntimeError, match="activation 'gelu' has no CPU kernel"):
        _packed_moe(x, index, weights, gate_up, down, False, "gelu")
    with pytest.raises(RuntimeError, match=r"expert index 5 out of range \[0, 2\)"):
        _packed_moe(x, torch.tensor([[5]]), weights, gate_up, down, False, "silu")
    strided = PackedWeight("fp8_block", down.data.transpose(1, 2).contiguous().transpose(1, 2), down.scales)
    with pytest.raises(RuntimeError, match=r"packed expert rows must be contiguous \(strides \[8192, 1, 128\]\)"):
        _packed_moe(x, index, weights, gate_up, strided, False, "silu")
    weight = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="x has 64 features, the weight takes 128"):
        torch.ops.dflash.fp8_block_linear(torch.zeros(1, 64), weight, torch.ones(1, 1), None)


def test_weights_on_another_device_than_the_hidden_states_are_named():
    gate_up, down = _experts("mxfp4", 2, 64, 32, bias=False, device="cpu")
    elsewhere = PackedWeight("mxfp4", gate_up.data.to("meta"), gate_up.scales.to("meta"))
    index, weights = _routing(1, 2, 1)
    with pytest.raises(ValueError, match="routed experts on meta/cpu but hidden states on cpu .* move them to one"):
        run_packed(torch.zeros(1, 64), index, weights, elsewhere, down, Gate(False, "silu"))


def test_dense_weights_at_any_strides():
    """A transposed view of [E, in, out] parameters (how gpt-oss stores its experts): read input-major (each input
    column is a contiguous run over the outputs), so its sums run in another order than the row-major path's."""
    gate_up, down = _experts("dense", 3, 64, 32, bias=True, device="cpu")
    index, weights = _routing(4, 3, 2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    as_stored = [PackedWeight("dense", w.data.transpose(1, 2).contiguous().transpose(1, 2), None, w.bias)
                 for w in (gate_up, down)]
    assert not as_stored[0].data.is_contiguous()
    torch.testing.assert_close(_packed_moe(x, index, weights, *as_stored, True, "clamped_swiglu"),
                               _packed_moe(x, index, weights, gate_up, down, True, "clamped_swiglu"), atol=1e-5,
                               rtol=1e-5)


def test_without_the_kernels_the_reference_runs(monkeypatch):
    """No sources (or no compiler): a warning that says why, and run_packed falls back to the reference."""
    monkeypatch.setattr(cpu, "SOURCES", [cpu.SOURCES[0].with_name("missing.cpp")])
    cpu.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"C\+\+ CPU kernels unavailable \(sources not found"):
            assert not cpu.load()
        assert cpu.status().startswith("C++ CPU kernels unavailable: sources not found")
        gate_up, down = _experts("mxfp4", 3, 64, 32, bias=False, device="cpu")
        index, weights = _routing(2, 3, 2)
        x = torch.randn(2, 64)
        gate = Gate(False, "silu")
        assert torch.equal(run_packed(x, index, weights, gate_up, down, gate),
                           reference_packed(x, index, weights, gate_up, down, gate))
    finally:
        cpu.load.cache_clear()


def test_a_broken_compiler_falls_back_with_the_reason(monkeypatch, tmp_path, caplog):
    """CXX naming a program that fails (its `--version` probe raises CalledProcessError inside torch's build): the
    kernels are reported unavailable with the build's error, not raised out of `load()`; the build was announced
    (no built module there), as a cached one is not."""
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no cached build to load instead
    cpu.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"C\+\+ CPU kernels unavailable \(build failed: .*/bin/false"):
            assert not cpu.load()
        assert "compiling dflash_cpu_kernels for this machine, once (a minute or two" in caplog.text
    finally:
        cpu.load.cache_clear()


def _is_planted(lock: Path) -> bool:
    """Whether the `lock` file is still the one the test planted (torch's own, which another test worker's load may
    hold for a moment, is empty)."""
    try:
        return lock.read_text() == STALE_LOCK
    except FileNotFoundError:
        return False


STALE_LOCK = "left by a killed build"


def test_a_build_lock_left_by_a_killed_build_does_not_stall_the_next_load():
    """Torch's `lock` file in the build directory, as a build killed midway leaves it (a timeout's SIGTERM): every
    later load of the kernels used to wait on it forever. A fresh process loads them (the set-up command's cached
    build) within the time limit and the stale lock is gone."""
    from torch.utils import cpp_extension

    assert cpu.load()  # built and cached before the lock is planted
    lock = Path(cpp_extension._get_build_directory("dflash_cpu_kernels", verbose=False)) / "lock"
    lock.write_text(STALE_LOCK)
    try:
        loaded = subprocess.run([sys.executable, "-c", "from dflash_compile.kernels import cpu; assert cpu.load()"],
                                check=True, timeout=300, capture_output=True, text=True)
        assert not _is_planted(lock)
        assert "compiling" not in loaded.stderr  # cached: loaded without a word
    finally:
        if _is_planted(lock):
            lock.unlink()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 200, 3), (300, 2880, 3), (300, 200, 20), (1100, 4096, 20)])
def test_fp8_block_linear_cpu_kernel(dtype, shape):
    """A dense FP8 layer with partial 128-blocks in both directions, [B, T, K] activations, a bias: 6 rows (weight
    rows dotted with them in groups of 4, over K in chunks of 1024: one chunk, or three with a partial last one),
    40 rows (weight rows decoded in blocks for a GEMM), and a weight of two such blocks (1100 x 4096 values,
    blocks of 2^22)."""
    from dflash_compile.quant import dequantize_fp8_block, quantize_fp8_block

    assert cpu.load() and torch._C._dispatch_has_kernel_for_dispatch_key("dflash::fp8_block_linear", "CPU")
    n, k, tokens = shape
    generator = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8_block(torch.randn(n, k, generator=generator))
    x = torch.randn(2, tokens, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    expected = x.double() @ dequantize_fp8_block(weight, scale).double().T + bias.double()
    actual = torch.ops.dflash.fp8_block_linear(x.to(dtype), weight, scale, bias.to(dtype))
    assert actual.shape == (2, tokens, n) and actual.dtype == dtype
    error = (actual.double() - expected).norm() / expected.norm()
    assert error <= (1e-4 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("columns", [48, 8])
def test_fp8_cpu_decode_of_every_code_is_exact(columns):
    """Every float8_e4m3fn byte (subnormals, the NaN codes 0x7F / 0xFF) at a scale that is not a power of two,
    through one-hot activations: torch's own e4m3 conversion times the scale, bit for bit -- in the vector path's
    16-wide steps (48 columns) and in its scalar tail (8; a NaN in either would spread over a whole row's dot)."""
    assert cpu.load()
    codes = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, columns).contiguous()
    weight = codes.view(torch.float8_e4m3fn)
    scale = torch.full((2, 1), 0.37)
    actual = torch.ops.dflash.fp8_block_linear(torch.eye(columns), weight, scale, None).T
    torch.testing.assert_close(actual, weight.float() * 0.37, atol=0, rtol=0, equal_nan=True)
