"""The CUDA C++ row kernels of one token's MoE layer (csrc/moe_rows_cuda.cu, `kernels.cuda_rows`): on by default where
they were measured faster (the H100 and the H200), asked for or turned off by DFLASH_CUDA_ROWS; on a Hopper GPU, gpt-oss MXFP4 and
Qwen3 FP8 layers against the reference, under CUDA graphs, and the calls they leave to Triton."""

import pytest
import torch

import dflash_compile
from dflash_compile.checkpoint import load_packed, quantize
from dflash_compile.kernels import cuda_rows
from dflash_compile.kernels.moe import fused_moe
from dflash_compile.packed import PackedWeight
from dflash_compile.testing import load_tiny_model, save_tiny_model
from tests.conftest import token_ids

from .test_moe import _experts, _routing, reference_moe

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the row kernels run on compute capability 9.0")


@pytest.fixture
def rows_on(monkeypatch):
    """DFLASH_CUDA_ROWS=1 for the test, the loader asked again before and after."""
    monkeypatch.setenv("DFLASH_CUDA_ROWS", "1")
    cuda_rows.load.cache_clear()
    yield
    monkeypatch.delenv("DFLASH_CUDA_ROWS")
    cuda_rows.load.cache_clear()


def _gpt_oss_layer(hidden, inter, experts=8, seed=0):
    """gate/up and down of a gpt-oss-style layer on the GPU, biases in bf16 as a bf16 model keeps them."""
    gate_up, down = _experts("mxfp4", experts, hidden, inter, bias=True, seed=seed, device="cuda")
    bf16 = lambda w: PackedWeight(w.format, w.data, w.scales, w.bias.to(torch.bfloat16))  # noqa: E731
    return bf16(gate_up), bf16(down)


def _loaded_with(monkeypatch, setting):
    """cuda_rows.load() with DFLASH_CUDA_ROWS=setting (None: unset, the default), asked afresh."""
    if setting is None:
        monkeypatch.delenv("DFLASH_CUDA_ROWS", raising=False)
    else:
        monkeypatch.setenv("DFLASH_CUDA_ROWS", setting)
    cuda_rows.load.cache_clear()
    return cuda_rows.load()


def test_the_row_kernels_can_be_turned_off_and_need_a_hopper_gpu(monkeypatch):
    assert _loaded_with(monkeypatch, "0") is None
    assert cuda_rows.status() == "CUDA row kernels unused: off (DFLASH_CUDA_ROWS=0)"
    if not HOPPER:  # on by default and when asked, but not without the GPU
        for setting in (None, "1"):
            assert _loaded_with(monkeypatch, setting) is None
            assert cuda_rows.status() == ("CUDA row kernels unused: they need a GPU of compute capability 9.0 "
                                          "(H100, H200)")
    with pytest.raises(ValueError, match=r"DFLASH_CUDA_ROWS='yes': use 1 \(the CUDA row kernels on\), 0 \(off\) or"):
        _loaded_with(monkeypatch, "yes")
    cuda_rows.load.cache_clear()


@needs_hopper
def test_by_default_the_row_kernels_run_on_the_gpus_they_are_faster_on(monkeypatch):
    name = torch.cuda.get_device_name()
    faster = any(gpu in name for gpu in cuda_rows.FASTER_ON)
    assert (_loaded_with(monkeypatch, None) is not None) == faster
    if not faster:
        assert cuda_rows.status() == (f"CUDA row kernels unused: off on the {name}: measured faster than the Triton "
                                      "kernels only on the H100, H200 (DFLASH_CUDA_ROWS=1 turns them on)")
    assert _loaded_with(monkeypatch, "1") is not None  # asked for: on any Hopper GPU
    cuda_rows.load.cache_clear()


def test_which_layouts_the_row_kernels_take():
    """The layout rules `covers` applies (any device: they read shapes and dtypes): gpt-oss's MXFP4 at top-4 with bf16
    biases; MXFP4 with SiLU, no biases, top-2/4/8; rows of up to 128 groups; Qwen3-FP8 at top-8, H <= 4096, I <= 2048
    in 16-byte chunks."""
    mxfp4, fp8 = cuda_rows.LAYOUTS["mxfp4"], cuda_rows.LAYOUTS["fp8_block"]
    top = lambda k: torch.zeros(1, k, dtype=torch.int64)  # noqa: E731
    bf16 = lambda w: PackedWeight(w.format, w.data, w.scales, w.bias.to(torch.bfloat16))  # noqa: E731
    gpt_oss = [bf16(w) for w in _experts("mxfp4", 2, 256, 128, bias=True, device="cpu")]
    assert mxfp4(top(4), *gpt_oss, True, "clamped_swiglu")
    assert not mxfp4(top(2), *gpt_oss, True, "clamped_swiglu")
    assert not mxfp4(top(4), *gpt_oss, False, "silu")  # biases: Triton's
    fp32_bias = PackedWeight("mxfp4", gpt_oss[0].data, gpt_oss[0].scales, gpt_oss[0].bias.float())
    assert not mxfp4(top(4), fp32_bias, gpt_oss[1], True, "clamped_swiglu")
    silu = _experts("mxfp4", 2, 256, 128, bias=False, device="cpu")
    assert all(mxfp4(top(k), *silu, False, "silu") for k in (2, 4, 8))
    assert not mxfp4(top(3), *silu, False, "silu") and not mxfp4(top(8), *silu, True, "silu")
    assert not mxfp4(top(8), *silu, False, "gelu_tanh")
    assert mxfp4(top(8), *_experts("mxfp4", 1, 4096, 64, bias=False, device="cpu"), False, "silu")  # 128 groups
    assert not mxfp4(top(8), *_experts("mxfp4", 1, 4128, 64, bias=False, device="cpu"), False, "silu")
    qwen3 = _experts("fp8_block", 2, 2048, 768, bias=False, device="cpu")
    assert fp8(top(8), *qwen3, False, "silu")
    assert not fp8(top(4), *qwen3, False, "silu") and not fp8(top(8), *qwen3, True, "silu")
    assert not fp8(top(8), *_experts("fp8_block", 1, 4224, 64, bias=False, device="cpu"), False, "silu")  # H > 4096
    assert not fp8(top(8), *_experts("fp8_block", 1, 256, 2064, bias=False, device="cpu"), False, "silu")  # I > 2048
    assert not fp8(top(8), *_experts("fp8_block", 1, 264, 64, bias=False, device="cpu"), False, "silu")  # 16 | H


def _matches_the_reference(gate_up, down, experts, top_k, interleaved, activation):
    """One bf16 token through the row kernels (`covers` says they take it): within 1e-2 of fp64 math on the
    dequantized weights (fp16 products, as the Triton row path), the same result on a second call. Returns the
    call's arguments and result."""
    hidden = gate_up.shape[2]
    index, weights = _routing(1, experts, top_k)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = reference_moe(x.float(), index, weights, gate_up, down, interleaved, activation)
    args = (x.cuda(), index.cuda(), weights.cuda(), gate_up, down)
    layout = dict(interleaved=interleaved, activation=activation)
    assert cuda_rows.covers(*args[:2], gate_up, down, interleaved, activation)
    actual = fused_moe(*args, **layout)
    assert actual.dtype == torch.bfloat16 and actual.shape == (1, hidden)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-2
    assert torch.equal(fused_moe(*args, **layout), actual)
    return args, layout


@needs_hopper
@pytest.mark.parametrize("hidden, inter", [(2880, 2880), (1024, 512)])  # 90 groups (three a lane for some), 16-32
def test_one_token_gpt_oss_layers_match_the_reference(rows_on, hidden, inter):
    """Interleaved gate/up, clamped SwiGLU, biases, top-4; bf16 routing weights give exactly their fp32 values'
    result (read in the kernel, as gpt-oss' router leaves them)."""
    args, layout = _matches_the_reference(*_gpt_oss_layer(hidden, inter), 8, 4, True, "clamped_swiglu")
    bf16 = args[2].bfloat16()
    assert torch.equal(fused_moe(*args[:2], bf16, *args[3:], **layout),
                       fused_moe(*args[:2], bf16.float(), *args[3:], **layout))


@needs_hopper
@pytest.mark.parametrize("format, hidden, inter, experts, top_k", [
    ("mxfp4", 2048, 768, 16, 8), ("mxfp4", 4096, 1024, 8, 2), ("mxfp4", 1024, 512, 8, 4), ("mxfp4", 2048, 4096, 16, 8),
    ("fp8_block", 2048, 768, 16, 8), ("fp8_block", 4096, 1408, 16, 8), ("fp8_block", 1024, 2048, 16, 8)])
def test_one_token_silu_layers_match_the_reference(rows_on, format, hidden, inter, experts, top_k):
    """Gate rows then up rows, SiLU, no biases, the activations between the launches in fp32, each expert's scaled to
    fp16 by the down kernel. MXFP4 as `quantize` writes it: Qwen3-30B-A3B's widths (64 and 24 groups: two and one a
    lane), Mixtral's top-2 at the widest K (128 groups, four a lane), top-4, and 8 experts x 128 groups of down
    activations (80 KB of shared memory). FP8 with 128 x 128 block scales: Qwen3-30B-A3B, GLM-4.5-Air (I = 1408: a
    partial scale block), the widest I."""
    _matches_the_reference(*_experts(format, experts, hidden, inter, bias=False, device="cuda"), experts, top_k, False,
                           "silu")


@needs_hopper
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_one_token_replayed_from_a_cuda_graph(rows_on, format):
    """Captured in a CUDA graph (both launches, the down one programmatically dependent), replayed on new inputs
    written in place: the eager call's result."""
    gpt_oss = format == "mxfp4"
    gate_up, down = _gpt_oss_layer(1024, 512) if gpt_oss else _experts(format, 16, 1024, 512, False, device="cuda")
    top_k, experts = (4, 8) if gpt_oss else (8, 16)
    index, weights = (t.cuda() for t in _routing(1, experts, top_k))
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    layout = dict(interleaved=True, activation="clamped_swiglu") if gpt_oss else {}
    assert cuda_rows.covers(x, index, gate_up, down, gpt_oss, "clamped_swiglu" if gpt_oss else "silu")
    call = lambda: fused_moe(x, index, weights, gate_up, down, **layout)  # noqa: E731
    call()  # compiles the extension and warms up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.copy_(torch.randn_like(x))
    index.copy_(_routing(1, experts, top_k, seed=5)[0].cuda())
    graph.replay()
    assert torch.equal(captured, call())


@needs_hopper
def test_calls_the_row_kernels_do_not_cover_run_triton(rows_on):
    """MXFP4 gpt-oss layouts with top-2 or fp32 biases, SiLU with biases, K past 128 groups, bf16 (dense) experts,
    FP8 top-4, and two tokens are left to the Triton kernels, still correct."""
    gate_up, down = _gpt_oss_layer(1024, 512)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    index, weights = (t.cuda() for t in _routing(1, 8, 2))
    assert not cuda_rows.covers(x, index, gate_up, down, True, "clamped_swiglu")
    index4 = _routing(1, 8, 4)[0].cuda()
    assert not cuda_rows.covers(x, index4, gate_up, down, False, "silu")  # SiLU with biases
    assert not cuda_rows.covers(x, index4, *_experts("dense", 8, 1024, 512, bias=False, device="cuda"), False, "silu")
    wide = _experts("mxfp4", 8, 4128, 512, bias=False, device="cuda")  # 129 groups
    assert not cuda_rows.covers(torch.randn(1, 4128, device="cuda", dtype=torch.bfloat16), index4, *wide, False,
                                "silu")
    fp32_bias = PackedWeight("mxfp4", gate_up.data, gate_up.scales, gate_up.bias.float())
    assert not cuda_rows.covers(x, index4, fp32_bias, down, True, "clamped_swiglu")
    fp8 = _experts("fp8_block", 16, 1024, 512, bias=False, device="cuda")
    assert cuda_rows.covers(x, _routing(1, 16, 8)[0].cuda(), *fp8, False, "silu")
    assert not cuda_rows.covers(x, _routing(1, 16, 4)[0].cuda(), *fp8, False, "silu")  # top-4 FP8: Triton
    assert not cuda_rows.covers(x.repeat(2, 1), _routing(2, 16, 8)[0].cuda(), *fp8, False, "silu")  # two tokens
    expected = reference_moe(x.float().cpu(), index.cpu(), weights.cpu(), gate_up, down, True, "clamped_swiglu")
    actual = fused_moe(x, index, weights, gate_up, down, interleaved=True, activation="clamped_swiglu")
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-2


@needs_hopper
def test_a_packed_gpt_oss_generates_through_the_row_kernels(rows_on, tmp_path, monkeypatch):
    """A tiny gpt-oss MXFP4 checkpoint loaded packed in bf16 on the GPU, top-4 of 8 experts (the row kernels'
    layout): `model.generate` on it runs its decode layers through the row kernels (counted), and `optimize`'s
    compiled step, captured in CUDA graphs, gives the same tokens."""
    directory = save_tiny_model("gpt_oss", tmp_path / "fp32", hidden_size=256, intermediate_size=256,
                                num_local_experts=8, num_experts_per_tok=4)
    model = load_tiny_model("gpt_oss", torch.bfloat16, directory)  # bf16 biases, as the release stores them
    packed = load_packed(quantize(model, tmp_path / "mxfp4", "mxfp4"), dtype=torch.bfloat16, device="cuda")
    calls = []
    one_token_moe = cuda_rows.one_token_moe
    monkeypatch.setattr(cuda_rows, "one_token_moe", lambda *args: calls.append(1) or one_token_moe(*args))
    ids = token_ids()[:1].cuda()
    expected = packed.generate(ids, max_new_tokens=12, do_sample=False)
    assert len(calls) >= 11 * packed.config.num_hidden_layers  # every decode step's every layer
    assert torch.equal(dflash_compile.optimize(packed).generate(ids, max_new_tokens=12), expected)
