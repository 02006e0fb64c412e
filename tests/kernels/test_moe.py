"""The fused MoE kernel against reference dequantization + fp32 math (fp32 path: Triton's interpreter on a CPU)."""

import pytest
import torch
import triton
import triton.language as tl

from dflash_compile.kernels.moe import _paired_columns, align_routing, fused_moe
from dflash_compile.packed import PackedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_moe(hidden, index, weights, gate_up: PackedWeight, down: PackedWeight, interleaved, activation,
                  alpha=1.702, limit=7.0):
    w1, w2 = gate_up.dequantize().cpu(), down.dequantize().cpu()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            h = hidden[t].double() @ w1[e].double().T
            if gate_up.bias is not None:
                h = h + gate_up.bias[e].double().cpu()
            gate, up = (h[0::2], h[1::2]) if interleaved else h.chunk(2)
            if activation == "relu2":  # no gate: h is up alone
                act = torch.relu(h).square()
            elif activation == "clamped_swiglu":
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            elif activation == "gelu_tanh":
                act = torch.nn.functional.gelu(gate, approximate="tanh") * up
            elif activation == "clamped_silu":
                act = torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
            elif activation == "clamped_gate_silu":
                act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            elif activation == "softcapped_swiglu":  # alpha: the gate's softcap, limit: up's
                act = torch.tanh(gate / alpha) * alpha * torch.sigmoid(gate) * torch.tanh(up / limit) * limit
            else:
                act = torch.nn.functional.silu(gate) * up
            y = act @ w2[e].double().T
            if down.bias is not None:
                y = y + down.bias[e].double().cpu()
            out[t] += weights[t, slot].double() * y
    return out


# experts, hidden, intermediate, top-k, tokens, interleaved gate/up, activation, biases
PRECISIONS = ["fp32", pytest.param("bf16", marks=pytest.mark.skipif(DEVICE == "cpu",
                                                                    reason="the interpreter's bf16 is wrong"))]
FAMILY_CASES = {
    "gpt_oss": (4, 2880, 32, 2, 2, True, "clamped_swiglu", True),  # K = 2880: not a multiple of 128
    # the same layout at K = 608 (also no multiple of 128) for the tests of one token's tiles, whose many small
    # programs the Triton interpreter runs ~5x faster than at 2880
    "gpt_oss_short": (4, 608, 32, 2, 2, True, "clamped_swiglu", True),
    "silu_concatenated": (3, 96, 160, 2, 3, False, "silu", False),  # 3 tokens sharing experts
    "gelu_concatenated": (3, 96, 160, 2, 3, False, "gelu_tanh", False),  # Gemma 4's GELU (tanh approximation)
}


def _experts(format, experts, hidden, inter, bias, seed=0, device=DEVICE, gated=True):
    """(gate_up [E, 2I, H], down [E, H, I]) packed in `format`; `gated=False`: up [E, I, H] alone first."""
    generator = torch.Generator().manual_seed(seed)
    first = 2 * inter if gated else inter
    w1 = torch.randn(experts, first, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    b1 = torch.randn(experts, first, generator=generator) * 0.1 if bias else None
    b2 = torch.randn(experts, hidden, generator=generator) * 0.1 if bias else None
    pack = lambda w, b: PackedWeight.quantize(w, format, b)  # noqa: E731
    move = lambda p: PackedWeight(p.format, p.data.to(device), None if p.scales is None else p.scales.to(device),  # noqa: E731
                                  None if p.bias is None else p.bias.to(device))
    return move(pack(w1, b1)), move(pack(w2, b2))


def _blobs(gate_up: PackedWeight, down: PackedWeight, pin_memory=False):
    """(layout, [E, blob bytes] host blobs): the experts in offload's layout."""
    from dflash_compile.offload import BlobLayout, blob_parts

    parts = blob_parts(gate_up, down)
    layout = BlobLayout.of(parts)
    return layout, layout.blobs(parts, pin_memory)


def _routing(tokens, experts, top_k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return index, weights


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("family", ["gpt_oss", "silu_concatenated", "gelu_concatenated"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_moe_matches_the_reference(format, family, precision):
    """gpt-oss: interleaved gate/up, clamped SwiGLU, biases, K = 2880 (not a multiple of 128); the other families:
    concatenated gate/up with SiLU (Gemma 4: GELU's tanh approximation), no bias, 3 tokens sharing experts (several
    pairs per block). The fp32 path to 1e-4; on a GPU also the bf16 path (PTX MXFP4 upcast, hardware fp8
    conversion) to 1e-2."""
    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES[family]
    gate_up, down = _experts(format, experts, hidden, inter, bias)
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, interleaved, activation)
    if precision == "bf16" and format == "dense":
        gate_up, down = (PackedWeight("dense", w.data.bfloat16(), None, w.bias) for w in (gate_up, down))
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    actual = fused_moe(x.to(DEVICE, dtype), index.to(DEVICE), weights.to(DEVICE), gate_up, down,
                       interleaved=interleaved, activation=activation)
    error = (actual.cpu().double() - expected).norm() / expected.norm()
    assert error <= (1e-4 if precision == "fp32" else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("activation", ["clamped_silu", "clamped_gate_silu", "softcapped_swiglu"])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_clamped_silu_clips_the_gate_and_up_projections(activation, format, tokens):
    """Step 3.7's clamped layers, SiLU(gate) <= limit, and HY V4's experts, SiLU(gate <= limit), each times up clamped
    to [-limit, limit], and Inkling 2's softcapped SwiGLU (up's softcap the limit, the gate's 1.702); a limit of 0.5
    clips most values of this test's projections (one token's launches and blocks of several tokens' pairs)."""
    experts, hidden, inter, top_k, _, interleaved, _, bias = FAMILY_CASES["silu_concatenated"]
    gate_up, down = _experts(format, experts, hidden, inter, bias)
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, interleaved, activation, limit=0.5)
    assert (expected - reference_moe(x, index, weights, gate_up, down, interleaved, "silu")).norm() > expected.norm()
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, interleaved=interleaved,
                       activation=activation, limit=0.5)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_ungated_experts_square_the_relu_of_up(precision, format, tokens):
    """Nemotron-H's experts: up [E, I, H] alone, relu(up)^2, then down; one token's launches (its tiles' K splits
    not taken: the first launch writes activations) and blocks of several tokens' pairs, biases included. The fp32
    path to 1e-4; on a GPU also the bf16 path (the down launch's fp16 operands for FP8) to 1e-2."""
    experts, hidden, inter, top_k, _, _, _, _ = FAMILY_CASES["silu_concatenated"]
    up, down = _experts(format, experts, hidden, inter, True, gated=False)
    if precision == "bf16" and format == "dense":
        up, down = (PackedWeight("dense", w.data.bfloat16(), None, w.bias) for w in (up, down))
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, up, down, False, "relu2")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    actual = fused_moe(x.to(DEVICE, dtype), index.to(DEVICE), weights.to(DEVICE), up, down, activation="relu2",
                       **({"split_k": 2} if tokens == 1 else {}))
    error = (actual.cpu().double() - expected).norm() / expected.norm()
    assert error <= (1e-4 if precision == "fp32" else 1e-2), f"relative error {error:.2e}"
    with pytest.raises(ValueError, match=r"down weight \[3, 96, 160\] does not match gate_up \[3, 160, 96\]: "
                                         r"expected \[E, H, I\] = \[3, 96, 80\]"):
        fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), up, down, activation="silu")


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_ungated_experts_dequantized_for_a_grouped_gemm(monkeypatch, format):
    """Many pairs per expert (`_dequantized_moe`, DEQUANTIZE_PAIRS lowered): relu(up + bias)^2 between the grouped
    GEMMs, in fp32, rounded once."""
    from dflash_compile.kernels import moe

    monkeypatch.setattr(moe, "DEQUANTIZE_PAIRS", dict.fromkeys(moe.DEQUANTIZE_PAIRS, 8))
    up, down = _experts(format, 4, 160, 64, bias=True, seed=15, gated=False)
    index, weights = _routing(48, 3, 2, seed=16)
    x = torch.randn(48, 160, generator=torch.Generator().manual_seed(17))
    expected = reference_moe(x, index, weights, up, down, False, "relu2")
    dequantized = moe._dequantized_moe
    monkeypatch.setattr(moe, "_dequantized_moe", lambda *args: calls.append(1) or dequantized(*args))
    calls = []
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), up, down, activation="relu2")
    assert calls and (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_one_token_is_its_own_blocks(format):
    """Decode: a single token's pairs are each a block of their own (no grouping launch): the reference's result,
    and the same rows as that token's in a batch, where its pairs share blocks with other tokens'."""
    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES["gpt_oss_short"]
    gate_up, down = _experts(format, experts, hidden, inter, bias)
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    run = lambda rows: fused_moe(x[rows].to(DEVICE), index[rows].to(DEVICE), weights[rows].to(DEVICE),  # noqa: E731
                                 gate_up, down, interleaved=interleaved, activation=activation).cpu()
    expected = reference_moe(x[:1], index[:1], weights[:1], gate_up, down, interleaved, activation)
    assert (run(slice(0, 1)).double() - expected).norm() / expected.norm() <= 1e-4
    # a one-token launch may split K (tile split_k): the same sums in another order
    torch.testing.assert_close(run(slice(0, 1)), run(slice(0, tokens))[:1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [1, 2])
def test_dense_rows_on_the_cuda_cores(block_m):
    """Dense (16-bit) experts for one token take the CUDA-core path (ROW_TILES["dense"]: a block of one row, not a
    16-row tensor-core tile), and blocks of 2 rows run there by a block_m override: the reference's result with K
    not a multiple of 32 (100) and biases. Experts stored transposed ([E, in, out], as gpt-oss keeps bf16 experts)
    keep the tensor-core tiles, and an override asking for the CUDA cores there is refused naming why."""
    from dflash_compile.kernels.moe import _row_blocker, rows_per_block, tiles_for

    assert rows_per_block(1, 8, 128, format="dense") == 1 and tiles_for("dense", {}, 1)["block_m"] == 1
    assert rows_per_block(4, 8, 128, format="dense") is None  # more tokens: the tensor cores
    gate_up, down = _experts("dense", 4, 100, 48, bias=True, seed=21)
    assert _row_blocker(gate_up, down) is None
    tokens = 1 if block_m == 1 else 3
    index, weights = _routing(tokens, 4, 2, seed=22)
    x = torch.randn(tokens, 100, generator=torch.Generator().manual_seed(23))
    expected = reference_moe(x, index, weights, gate_up, down, False, "silu")
    tiles = {} if block_m == 1 else {"block_m": block_m}
    run = lambda *experts, **more: fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), *experts,  # noqa: E731
                                             compute_fp32=True, **tiles, **more)
    assert (run(gate_up, down).cpu().double() - expected).norm() / expected.norm() <= 1e-4
    transposed = [PackedWeight("dense", w.data.transpose(1, 2).contiguous().transpose(1, 2), None, w.bias)
                  for w in (gate_up, down)]
    if block_m == 1:  # the tensor-core tiles' sums: the reference's result as well
        assert (run(*transposed).cpu().double() - expected).norm() / expected.norm() <= 1e-4
    else:
        with pytest.raises(ValueError, match=r"block_m must be >= 16 here: the CUDA-core path reads dense weight "
                                             r"rows contiguous along K, and these are strided \(transposed\), got 2"):
            run(*transposed)


@pytest.mark.parametrize("family, scale", [("gpt_oss", 1.0), ("gpt_oss", 3e5), ("silu_concatenated", 1.0),
                                           ("silu_concatenated", 1e3)])
def test_fp16_operands_for_fp8_weights(family, scale):
    """operands="fp16": FP8 weights and prescaled activations as fp16 tensor-core operands (no fp32 path: the
    interpreter's fp16 is right). Matches the reference more closely than the bf16 path must, and activations past
    fp16's 65504 stay finite through the prescale: inputs of 3e5 (gpt-oss clamps its intermediates), SiLU
    intermediates of ~1e6 (their limit is 1.6e7)."""
    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES[family]
    gate_up, down = _experts("fp8_block", experts, hidden, inter, bias)
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)) * scale
    # large activations and outputs are past fp16's range before and after the kernels: fp16 inputs at scale 1 only
    dtypes = (torch.float32, torch.float16) if scale == 1.0 else (torch.float32,)
    expected = {dtype: reference_moe(x.to(dtype).float(), index, weights, gate_up, down, interleaved, activation)
                for dtype in dtypes}
    # one token (on the tensor cores: blocks of 16, not its CUDA-core path): its activations are scaled inside the
    # kernel, unless they come in fp16 (a model run in fp16)
    for rows, dtype in ((slice(0, tokens), torch.float32), (slice(0, 1), torch.float32), (slice(0, 1), torch.float16)):
        if dtype not in expected:
            continue
        actual = fused_moe(x[rows].to(DEVICE, dtype), index[rows].to(DEVICE), weights[rows].to(DEVICE), gate_up, down,
                           interleaved=interleaved, activation=activation, compute_fp32=False, operands="fp16",
                           block_m=16)
        expected_rows = expected[dtype][rows]
        error = (actual.cpu().double() - expected_rows).norm() / expected_rows.norm()
        assert actual.isfinite().all() and error <= 2e-3, f"{dtype}: relative error {error:.2e}"
    with pytest.raises(ValueError, match="operands must be 'bf16' or 'fp16', got 'fp8'"):
        fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, operands="fp8")
    with pytest.raises(ValueError, match=r"unknown tile settings \['operands'\]"):
        fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), *_experts("mxfp4", experts, hidden, inter, bias),
                  operands="fp16")


@pytest.mark.parametrize("index, experts, block_m", [
    (torch.tensor([[2, 0], [2, 1], [2, 0], [3, 2]]), 5, 2),
    (_routing(40, 128, 8, seed=5)[0], 128, 16),  # 320 pairs, 128 experts: several chunks of pairs and blocks
    (_routing(70, 6, 3, seed=6)[0], 6, 1),  # 210 pairs, crowded experts, one pair per block
])
def test_routing_blocks_hold_one_expert_each(index, experts, block_m):
    """Every pair lands exactly once, in a block of its own expert, experts in order. (Within an expert the GPU's
    atomics may order pairs any way; the interpreter keeps their order.)"""
    pair_ids, block_expert = align_routing(index.to(DEVICE), num_experts=experts, block_m=block_m)
    pair_ids, block_expert = pair_ids.cpu(), block_expert.cpu()
    flat = index.flatten()
    seen = []
    for block, expert in enumerate(block_expert.tolist()):
        ids = [p for p in pair_ids[block * block_m: (block + 1) * block_m].tolist() if p < flat.numel()]
        if expert < 0:
            assert ids == []
            continue
        assert ids and all(flat[p] == expert for p in ids)
        seen += ids
    assert sorted(seen) == list(range(flat.numel()))  # every pair exactly once
    assert [int(flat[p]) for p in seen] == sorted(flat.tolist())  # grouped by expert, experts ascending


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter runs atomics in order: only the GPU can reorder pairs")
def test_verify_sizes_are_bitwise_reproducible():
    """`align_routing`'s atomics order an expert's pairs differently from call to call on the GPU; the result may
    not change with it (each pair is one row of its block's GEMM)."""
    gate_up, down = _experts("fp8_block", 8, 256, 128, False)
    index, weights = _routing(16, 8, 4, seed=3)  # 64 pairs on 8 experts: 8 pairs per expert on average
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    runs = [fused_moe(x, index.to(DEVICE), weights.to(DEVICE), gate_up, down) for _ in range(20)]
    orders = lambda: {tuple(align_routing(index.to(DEVICE), 8, 16)[0].tolist()) for _ in range(20)}  # noqa: E731
    assert all(torch.equal(run, runs[0]) for run in runs), f"results differ over {len(orders())} pair orders"


def test_bad_shapes_are_named():
    gate_up, down = _experts("dense", 2, 64, 32, False)
    with pytest.raises(ValueError, match=r"down weight \[2, 64, 64\] does not match gate_up \[2, 64, 64\]: "
                                         r"expected \[E, H, I\] = \[2, 64, 32\]"):
        fused_moe(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), gate_up, gate_up)
    with pytest.raises(ValueError, match="mxfp4 expert weight .* needs scales"):
        PackedWeight("mxfp4", torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="activation 'gelu' has no fused kernel"):
        fused_moe(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), gate_up, down,
                  activation="gelu")
    with pytest.raises(ValueError, match=r"routed_experts must be at least 1 \(or None: every expert\), got 0"):
        fused_moe(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), gate_up, down,
                  routed_experts=0)


@pytest.mark.parametrize("format, block_n, block_k", [("mxfp4", 16, 256), ("mxfp4", 64, 32), ("fp8_block", 16, 128),
                                                      ("fp8_block", 64, 32), ("dense", 16, 256)])
def test_tile_sizes_do_not_change_the_result(format, block_n, block_k):
    """K tiles of one MXFP4 group (32) up to 256, FP8 tiles inside a 128-column scale block, narrow and wide N
    tiles (the gate/up tile holds 2 * block_n rows)."""
    gate_up, down = _experts(format, 3, 320, 96, bias=True, seed=2)
    index, weights = _routing(5, 3, 2, seed=3)
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(4))
    expected = reference_moe(x, index, weights, gate_up, down, False, "silu")
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, compute_fp32=True,
                       block_n=block_n, block_k=block_k)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4


def test_tiles_the_kernel_cannot_run_are_refused():
    gate_up, down = _experts("fp8_block", 2, 128, 64, bias=False)
    index, weights = _routing(1, 2, 1)
    call = lambda **tiles: fused_moe(torch.zeros(1, 128, device=DEVICE), index.to(DEVICE), weights.to(DEVICE),  # noqa: E731
                                     gate_up, down, **tiles)
    with pytest.raises(ValueError, match="fp8_block tensor-core tiles need block_k <= 128"):
        call(block_k=256, block_m=16)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        call(block_k=96)
    with pytest.raises(ValueError, match=r"unknown tile settings \['block_z'\]"):
        call(block_z=8)
    odd_rows = _experts("fp8_block", 2, 130, 64, bias=False)  # K = 130: not whole 32-code groups
    with pytest.raises(ValueError, match=r"block_m must be >= 16 here: the CUDA-core path reads weight rows in whole "
                                         r"32-code groups, and these rows are not \(FP8: K a multiple of 32\), got 2"):
        fused_moe(torch.zeros(1, 130, device=DEVICE), index.to(DEVICE), weights.to(DEVICE), *odd_rows, block_m=2)
    with pytest.raises(ValueError, match="block_m must be a power of two, got 3"):
        call(block_m=3)
    from dflash_compile.kernels.moe import packed_linear

    with pytest.raises(ValueError, match="down_launch sets an MoE call's down launch apart; a dense layer has one"):
        packed_linear(torch.zeros(1, 64, device=DEVICE), PackedWeight("fp8_block", down.data[:1], down.scales[:1]),
                      down_launch={"block_n": 16})


def _older_gpu(monkeypatch, capability=(8, 0)):
    """torch.cuda reporting an A100 (compute capability 8.0: no hardware e4m3 conversions)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


def test_fp8_kernels_need_hardware_e4m3_conversions(monkeypatch):
    """`fused_blocker`: FP8 weights outside the fp32 path need compute capability 8.9 or newer, and below it the
    reason names the GPU; MXFP4, the fp32 path and the CPU run anywhere."""
    from dflash_compile.kernels.moe import fused_blocker

    _older_gpu(monkeypatch)
    cuda = torch.device("cuda", 0)
    assert fused_blocker("fp8_block", cuda) == ("FP8 weights need the e4m3 conversions of a GPU of compute "
                                                "capability 8.9 or newer (Ada, Hopper); NVIDIA A100-SXM4-80GB is 8.0")
    assert fused_blocker("fp8_block", cuda, compute_fp32=True) is None
    assert fused_blocker("mxfp4", cuda) is None
    assert fused_blocker("fp8_block", torch.device("cpu")) is None
    _older_gpu(monkeypatch, (8, 9))
    assert fused_blocker("fp8_block", cuda) is None


@pytest.mark.skipif(DEVICE == "cpu", reason="the CUDA dispatch")
def test_fp8_on_an_older_gpu_takes_the_reference_path(monkeypatch):
    """On a GPU without e4m3 conversions (reported as an A100 here), FP8 experts and dense layers run the
    reference's dequantize-then-matmul instead of a kernel that would not compile, and the fused entry points
    refuse with the reason."""
    from dflash_compile.expert_store import Gate, run_packed
    from dflash_compile.kernels.moe import packed_linear
    from dflash_compile.ops import fp8_block_linear

    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES["silu_concatenated"]
    gate_up, down = _experts("fp8_block", experts, hidden, inter, bias)
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, interleaved, activation)
    _older_gpu(monkeypatch)
    rows = x.to(DEVICE, torch.bfloat16)
    actual = run_packed(rows, index.to(DEVICE), weights.to(DEVICE), gate_up, down, Gate(interleaved, activation))
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-2
    with pytest.raises(ValueError, match=r"FP8 weights need the e4m3 conversions .* A100-SXM4-80GB is 8.0: run these"):
        fused_moe(rows, index.to(DEVICE), weights.to(DEVICE), gate_up, down)
    linear = fp8_block_linear(rows, gate_up.data[0].view(torch.float8_e4m3fn), gate_up.scales[0], None)
    dense = rows.double() @ gate_up.dequantize(torch.float64)[0].T
    assert (linear.double() - dense).norm() / dense.norm() <= 1e-2
    with pytest.raises(ValueError, match="use dflash::fp8_block_linear, which dequantizes the weight there"):
        packed_linear(rows, PackedWeight("fp8_block", gate_up.data[:1], gate_up.scales[:1]))


def test_tma_weight_loads_are_refused_where_they_cannot_run():
    """The TMA path (`weight_loads="tma"`) is chosen by itself where it runs; asked for elsewhere, the error says
    why, before any launch."""
    from dflash_compile.kernels.moe import tiles_for

    index, weights = _routing(1, 2, 1)

    def call(gate_up, down, x):
        return fused_moe(x, index.to(DEVICE), weights.to(DEVICE), gate_up, down, interleaved=True, weight_loads="tma")

    with pytest.raises(ValueError, match=r"weight_loads='tma' cannot be used here: only \['fp8_block', 'mxfp4'\] "
                                         r"weights have a TMA path, these are dense; use weight_loads='pointers'"):
        call(*_experts("dense", 2, 128, 64, bias=False), torch.zeros(1, 128, device=DEVICE))
    with pytest.raises(ValueError, match=r"TMA needs weight rows of whole 16-byte units, these have \[136, 64\]"):
        call(*_experts("fp8_block", 2, 136, 64, bias=False), torch.zeros(1, 136, device=DEVICE))
    with pytest.raises(ValueError, match="cannot be used here: the fp32 compute path"):
        call(*_experts("mxfp4", 2, 128, 64, bias=False), torch.zeros(1, 128, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight_loads='tma' is for the CUDA-core path \(block_m < 16\), got "
                                         r"block_m 16"):
        tiles_for("mxfp4", {"weight_loads": "tma", "block_m": 16})
    with pytest.raises(ValueError, match=r"weight_loads must be one of \('pointers', 'tma'\), got 'async'"):
        tiles_for("mxfp4", {"weight_loads": "async"}, 1)
    assert tiles_for("mxfp4", {}, 1, "tma")["weight_loads"] == "tma"
    assert tiles_for("mxfp4", {}, None, "tma")["weight_loads"] == "pointers"  # the tensor-core tiles


@pytest.mark.skipif(DEVICE == "cpu", reason="TMA runs on a Hopper GPU only")
@pytest.mark.parametrize("tokens, tiles", [(1, {}), (1, {"split_k": 2}), (4, {"block_m": 2})])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_tma_and_pointer_loads_agree(format, tokens, tiles, interleaved):
    """The weight words through TMA descriptors or through pointers, on the same tiles, both match the reference,
    with K = 2880 (the last step's words past K zero-filled by TMA) and the last gate/up tile half past the expert's
    192 rows (TMA reads on into the next expert or zeros; those columns are not stored); gate/up rows interleaved
    (one TMA tile) or concatenated (gate and up halves). Not bit for bit: the words' register layout differs, and
    with it the order in which a row's groups are summed."""
    experts, hidden, inter, top_k, activation = 4, 2880, 96, 2, "clamped_swiglu"
    gate_up, down = _experts(format, experts, hidden, inter, bias=True, seed=12)
    index, weights = _routing(tokens, experts, top_k, seed=13)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(14)).bfloat16()
    expected = reference_moe(x.float(), index, weights, gate_up, down, interleaved, activation)
    run = lambda loads: fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down,  # noqa: E731
                                  interleaved=interleaved, activation=activation, weight_loads=loads, block_n=64,
                                  num_warps=8, num_stages=3, **tiles).cpu().double()
    by_tma, by_pointers = run("tma"), run("pointers")
    for actual in (by_tma, by_pointers):
        assert (actual - expected).norm() / expected.norm() <= 1e-2
    assert (by_tma - by_pointers).norm() / expected.norm() <= 2e-3


@pytest.mark.skipif(DEVICE == "cpu", reason="the PTX upcast runs on a GPU only")
@pytest.mark.parametrize("rows_per_call", [384, 1])
def test_mxfp4_upcast_decodes_every_code_at_every_scale_exactly(rows_per_call):
    """The GPU's MXFP4 decodes, to bf16 for the tensor cores (`_E2M1_BF16_ASM`, all rows in one call) and to fp16
    on the CUDA cores (`_E2M1_ROW_ASM`, one row per call): all 256 bytes at E8M0 exponents from 1 (2^-126, bf16
    subnormal products) to 250 (6 * 2^123, near bf16's top), through one-hot activations that read each weight back
    unrounded; the exponent 0 (2^-127) decodes as 0 (its largest value, 6 * 2^-127, is below 1e-37)."""
    from dflash_compile.kernels.moe import packed_linear

    exponents = torch.tensor([1, 2, 100, 119, 126, 127, 128, 129, 140, 200, 250, 0], dtype=torch.uint8)
    rows, groups = 256, exponents.numel()
    codes = torch.arange(rows, dtype=torch.uint8)[:, None, None].expand(1, rows, groups, 16).contiguous()
    scales = exponents.roll(1)[None, None, :].expand(1, rows, groups).contiguous()
    scales[0, ::2] = exponents  # two orders, so each exponent meets the group layout at another offset
    weight = PackedWeight("mxfp4", codes.to(DEVICE), scales.to(DEVICE))
    one_hot = torch.eye(32 * groups, dtype=torch.bfloat16, device=DEVICE)
    actual = torch.cat([packed_linear(rows, weight) for rows in one_hot.split(rows_per_call)]).T.float().cpu()
    expected = weight.dequantize(torch.float32)[0].cpu().bfloat16().float()
    smallest = (scales[0].repeat_interleave(32, dim=1) == 0).cpu()
    torch.testing.assert_close(actual[~smallest], expected[~smallest], atol=0, rtol=0)
    assert actual[smallest].abs().max() <= 1e-37


@pytest.mark.skipif(DEVICE == "cpu", reason="the PTX decode runs on a GPU only")
def test_fp8_row_decode_of_every_byte_is_exact():
    """The CUDA-core path's FP8 decode (`_E4M3_ROW_ASM`, one row per call): all 256 float8_e4m3fn bytes, at block
    scales from 2^-100 to 2^100 and a non-power of two, through one-hot activations that read each weight back
    unrounded (the activation goes to fp16 as 4, each product and sum is exact) but for the output's bf16; the NaN
    bytes stay NaN."""
    from dflash_compile.kernels.moe import packed_linear

    block_scales = torch.tensor([2.0**-100, 0.75, 1.0, 2.0**100])
    codes = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 128 * block_scales.numel())
    scales = block_scales[None, None, :].expand(1, 2, -1).contiguous()
    weight = PackedWeight("fp8_block", codes.contiguous()[None].to(DEVICE), scales.to(DEVICE))
    one_hot = torch.eye(codes.shape[1], dtype=torch.bfloat16, device=DEVICE)
    actual = torch.cat([packed_linear(row, weight, block_m=1) for row in one_hot.split(1)]).T.float().cpu()
    expected = weight.dequantize(torch.float32)[0].cpu().bfloat16().float()  # the output's dtype: x's
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="the PTX decode runs on a GPU only")
@pytest.mark.parametrize("scale, outlier", [(1.0, None), (1e-3, None), (3e5, None), (1.0, 1e4)])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_one_row_activations_of_any_magnitude(format, scale, outlier):
    """One token times MXFP4 or FP8 weights on the CUDA cores: activations go to fp16 scaled by a power of two
    chosen from their largest magnitude, so tiny ones (1e-3), huge ones (3e5, past fp16's 65504) and one outlier
    among unit values all stay within the bf16 path's 1e-2 of the reference."""
    experts, hidden, inter, top_k, _, interleaved, activation, bias = FAMILY_CASES["gpt_oss"]
    gate_up, down = _experts(format, experts, hidden, inter, bias)
    index, weights = _routing(1, experts, top_k)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)) * scale
    if outlier is not None:
        x[0, 7] = outlier
    x = x.bfloat16()
    expected = reference_moe(x.float(), index, weights, gate_up, down, interleaved, activation)
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, interleaved=interleaved,
                       activation=activation)
    error = (actual.cpu().double() - expected).norm() / expected.norm()
    assert actual.isfinite().all() and error <= 1e-2, f"relative error {error:.2e}"


@triton.jit
def _store_paired_columns(out, N: tl.constexpr):
    columns = tl.arange(0, N)
    tl.store(out + columns, _paired_columns(columns))


def test_paired_activations_are_the_row_paths_pairs():
    """Where gate/up stores activation column c for a down launch on the MXFP4 row path (`_paired_columns`): read
    back as 32-bit words, word 4w + i holds word w's fp16x2 pair i, columns 8w + _row_pairs()[i] and that + 2, low
    half first: the order `_e2m1_word_pairs` decodes a packed word's codes in."""
    positions = torch.empty(64, dtype=torch.int32, device=DEVICE)
    _store_paired_columns[(1,)](positions, N=64)
    column_at = {int(p): c for c, p in enumerate(positions.cpu())}
    assert sorted(column_at) == list(range(64))  # a permutation
    for position, column in column_at.items():
        word, half = divmod(position, 2)
        w, i = divmod(word, 4)
        assert column == 8 * w + (0, 4, 1, 5)[i] + 2 * half


@pytest.mark.parametrize("scale", [1e-3, 1.0, 3e5, 0.0])
def test_pair_rows_scales_each_row_into_fp16_and_pairs_it(scale):
    """`_pair_rows`, the gate/up launch's activations on the row path: each row times the power of two that puts
    its largest magnitude in [2^14, 2^15) (rows of 1e-3, 1 and 3e5, past fp16's top; all zeros), in fp16, at
    `_paired_columns`' positions."""
    from dflash_compile.kernels.moe import _pair_rows

    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)) * torch.tensor([[scale], [1.0], [scale]])
    pairs, shifts = _pair_rows(x.bfloat16().to(DEVICE))
    positions = torch.empty(128, dtype=torch.int32, device=DEVICE)
    _store_paired_columns[(1,)](positions, N=128)
    unpaired = pairs.cpu()[:, positions[:96].cpu().long()].float()
    x = x.bfloat16().float()
    for row, shift in enumerate(shifts.cpu().tolist()):
        largest = x[row].abs().max()
        assert largest == 0 or 2**14 <= largest * 2.0**shift < 2**15
        torch.testing.assert_close(unpaired[row], (x[row] * 2.0**shift).half().float(), atol=0, rtol=0)


def test_paired_shift_puts_clamped_swiglus_bound_under_fp16s_top():
    """The down launch's fp16 pairs (PAIRED_SHIFT): gpt-oss's clamped SwiGLU outputs are at most (7 + 1) * 7 = 56,
    which the shift puts in [2^14, 2^15); off where the activations are unbounded (SiLU)."""
    from dflash_compile.kernels.moe import _paired_shift

    assert 2**14 <= 56 * 2 ** _paired_shift("clamped_swiglu", 1.702, 7.0) < 2**15
    assert _paired_shift("silu", 1.702, 7.0) == 0


@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_blocks_of_two_rows_on_the_cuda_cores(format, precision, block_k):
    """MXFP4 or FP8 blocks of 2 rows (verify sizes with about one pair per expert) on the CUDA-core path: each
    row's activations get their own fp16 scale, so tokens of very different magnitudes (1e-3, 1, 3e5) sharing an
    expert's block all stay within tolerance, as does the padding row of a block with one pair; in one K step of
    256 or two of 128 (the loop's next step loaded ahead)."""
    gate_up, down = _experts(format, 4, 256, 64, bias=True, seed=9)
    index = torch.tensor([[0, 1], [0, 2], [1, 3]])  # expert 0 and 1: two pairs each; 2 and 3: one (a padded block)
    weights = torch.softmax(torch.randn(3, 2, generator=torch.Generator().manual_seed(10)), dim=-1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(11)) * torch.tensor([[1e-3], [1.0], [3e5]])
    x = x if precision == "fp32" else x.bfloat16()
    expected = reference_moe(x.float(), index, weights, gate_up, down, True, "clamped_swiglu")
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, interleaved=True,
                       activation="clamped_swiglu", block_m=2, block_k=block_k).cpu().double()
    for token in range(3):  # each token against its own magnitude
        error = (actual[token] - expected[token]).norm() / expected[token].norm()
        assert error <= (1e-4 if precision == "fp32" else 1e-2), f"token {token}: relative error {error:.2e}"


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_empty_inputs_give_empty_outputs(format):
    """No tokens: an MoE call and a dense layer return empty outputs of the right shape and dtype, as torch's linear
    and the CPU kernels do (the grids would be empty, and the pairs per expert a division by zero)."""
    from dflash_compile.kernels.moe import packed_linear

    gate_up, down = _experts(format, 4, 64, 32, bias=False)
    index, weights = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), torch.zeros(0, 2, device=DEVICE)
    out = fused_moe(torch.zeros(0, 64, device=DEVICE), index, weights, gate_up, down)
    assert out.shape == (0, 64) and out.dtype == torch.float32
    for shape in ((0, 64), (2, 0, 64)):
        out = packed_linear(torch.zeros(shape, device=DEVICE), gate_up.select([0]))
        assert out.shape == (*shape[:-1], 64) and out.dtype == torch.float32


def test_inconsistent_routing_shapes_are_named():
    """Routing that does not match the hidden states is refused before any launch, with the shapes it got."""
    gate_up, down = _experts("mxfp4", 4, 64, 32, bias=False)
    x, index, weights = torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    bad = {"rows": (x, index[:2], weights[:2]), "weights": (x, index, weights[:, :1]),
           "tokens not flattened": (x[None], index, weights)}
    for name, (hidden, top_k_index, top_k_weights) in bad.items():
        with pytest.raises(ValueError, match=r"must be \[M, H\], \[M, k\] and \[M, k\]: flatten the tokens first"):
            fused_moe(hidden.to(DEVICE), top_k_index.to(DEVICE), top_k_weights.to(DEVICE), gate_up, down)
    with pytest.raises(ValueError, match="top_k_index must hold integer expert ids, got torch.float32"):
        fused_moe(x.to(DEVICE), index.float().to(DEVICE), weights.to(DEVICE), gate_up, down)


def test_rows_per_block_follows_the_pairs_per_routed_expert():
    """One token: a block per pair; about one pair per routed expert: blocks of 2 on the CUDA cores; more, or experts
    read from host memory: None (tensor-core tiles of 16); a prefill's 32+ pairs per expert: WIDE_TILES' blocks
    (MXFP4 64, from 96 pairs 128; FP8 32)."""
    from dflash_compile.kernels.moe import rows_per_block

    assert rows_per_block(1, 4, 32) == 1
    assert rows_per_block(4, 4, 32) == 2  # gpt-oss-20b verifying 4 tokens: 1.19 pairs per routed expert
    assert rows_per_block(16, 4, 128) == 2  # gpt-oss-120b, 16 tokens: 1.25
    assert rows_per_block(8, 4, 32) is None  # gpt-oss-20b, 8 tokens: 1.56
    assert rows_per_block(64, 8, 128) is None
    assert rows_per_block(16, 4, 32, weight_loads="tma") == 2  # the TMA row path holds up to 3.3 pairs
    assert rows_per_block(24, 4, 32, weight_loads="tma") == 2  # 3.13
    assert rows_per_block(32, 4, 32, weight_loads="tma") is None  # 4.06
    # offload: experts without a slot cross PCIe per block that reads them, so only one token keeps blocks of one
    assert rows_per_block(8, 8, 128, weight_loads="tma", format="fp8_block") == 2  # Qwen3-FP8, 8 tokens: 1.36
    assert rows_per_block(16, 8, 128, weight_loads="tma", format="fp8_block") is None  # 1.51
    assert rows_per_block(8, 8, 128, weight_loads="pointers", format="fp8_block") is None
    assert rows_per_block(4, 4, 32, reads_host=True) is None
    assert rows_per_block(1, 4, 32, reads_host=True) == 1
    assert rows_per_block(1024, 4, 32) == 128  # gpt-oss-20b prefill: 128 pairs per routed expert
    assert rows_per_block(2048, 8, 128) == 128  # Qwen3-30B-A3B MXFP4: 128
    assert rows_per_block(1024, 4, 32, reads_host=True) == 128  # one read of an expert per 128 pairs
    assert rows_per_block(1024, 8, 128) == 64  # 64
    assert rows_per_block(256, 4, 32) == 64  # 32
    assert rows_per_block(128, 4, 32) is None  # 16
    assert rows_per_block(1024, 4, 32, compute_fp32=True) is None  # fp32 tiles of 128 rows: too much shared memory
    assert rows_per_block(2048, 8, 128, weight_loads="tma", format="fp8_block") == 32  # Qwen3-FP8 prefill: 128
    assert rows_per_block(256, 8, 128, weight_loads="tma", format="fp8_block") is None  # 16
    assert rows_per_block(2048, 8, 128, format="dense") is None  # no wide tiles


def test_wide_tiles_by_rows_per_block():
    """Blocks of WIDE_TILES' rows or more take the entry of the most rows up to theirs (MXFP4 64+ and FP8 32+:
    fewer K steps in flight), by size or by a block_m override; fewer rows and other formats keep their TILES."""
    from dflash_compile.kernels.moe import TILES, tiles_for

    assert tiles_for("mxfp4", {}, 128)["block_m"] == 128 and tiles_for("mxfp4", {}, 128)["num_stages"] == 2
    assert tiles_for("mxfp4", {"block_m": 64})["num_stages"] == 2
    assert tiles_for("mxfp4", {"num_stages": 3}, 128)["num_stages"] == 3
    assert tiles_for("mxfp4", {"block_m": 32})["num_stages"] == TILES["mxfp4"]["num_stages"]
    assert tiles_for("fp8_block", {}, 32)["num_stages"] == 3
    assert tiles_for("fp8_block", {"block_m": 64})["num_stages"] == 3
    assert tiles_for("dense", {"block_m": 64})["num_stages"] == TILES["dense"]["num_stages"]
    assert tiles_for("mxfp4", {}, None)["block_m"] == 16


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("format, tokens, rows", [("mxfp4", 256, 128), ("mxfp4", 128, 64), ("fp8_block", 128, 32)])
def test_prefill_sized_calls_take_wide_blocks_and_match_the_reference(precision, format, tokens, rows):
    """`tokens` over 4 experts, top-2: tokens / 2 pairs per routed expert, so bf16 activations take WIDE_TILES'
    blocks of `rows` by default (MXFP4: 128 from 96 pairs, 64 from 32; FP8: 32; an expert's last block partly
    padding); the same tiles by a block_m override in the fp32 path (fewer K steps in flight hold its fp32 tiles
    too). MXFP4 as gpt-oss (interleaved clamped SwiGLU with biases), FP8 as Qwen3 (SiLU); K not a multiple of 128."""
    mxfp4 = format == "mxfp4"
    gate_up, down = _experts(format, 4, 160, 64, bias=mxfp4, seed=12)
    index, weights = _routing(tokens, 4, 2, seed=13)
    x = torch.randn(tokens, 160, generator=torch.Generator().manual_seed(14))
    layout = dict(interleaved=mxfp4, activation="clamped_swiglu" if mxfp4 else "silu")
    expected = reference_moe(x, index, weights, gate_up, down, layout["interleaved"], layout["activation"])
    dtype, wide = (torch.float32, dict(block_m=rows)) if precision == "fp32" else (torch.bfloat16, {})
    inputs = x.to(DEVICE, dtype), index.to(DEVICE), weights.to(DEVICE), gate_up, down
    actual = fused_moe(*inputs, **layout, **wide)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= (1e-4 if precision == "fp32" else 1e-2)
    if precision == "bf16":  # the default is the wide tiles
        torch.testing.assert_close(actual, fused_moe(*inputs, **layout, block_m=rows), atol=0, rtol=0)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("group_elements, grouped_gemms", [(2 * 64 * 160, 6), (1 << 29, 2)])
def test_many_pairs_per_expert_dequantize_for_a_grouped_gemm(monkeypatch, precision, format, group_elements,
                                                              grouped_gemms):
    """From DEQUANTIZE_PAIRS pairs per routed expert (lowered here) a call runs `_dequantized_moe`: experts
    dequantized a group at a time (one expert per group, an unrouted expert's group skipped, or all at once:
    DEQUANTIZE_EXPERT_ELEMENTS) and two `torch._grouped_mm` calls per group. MXFP4 as gpt-oss (interleaved clamped
    SwiGLU, biases), FP8 and dense weights (stored transposed) with SiLU; K = 160, not a multiple of 128."""
    from dflash_compile.kernels import moe

    monkeypatch.setattr(moe, "DEQUANTIZE_PAIRS", dict.fromkeys(moe.DEQUANTIZE_PAIRS, 8))
    monkeypatch.setattr(moe, "DEQUANTIZE_EXPERT_ELEMENTS", group_elements)
    grouped_mm, calls = torch._grouped_mm, []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: calls.append(1) or grouped_mm(*args, **kwargs))
    mxfp4 = format == "mxfp4"
    gate_up, down = _experts(format, 4, 160, 64, bias=mxfp4, seed=15)
    index, weights = _routing(48, 3, 2, seed=16)  # experts 0-2 of 4: 32 pairs each
    x = torch.randn(48, 160, generator=torch.Generator().manual_seed(17))
    layout = dict(interleaved=mxfp4, activation="clamped_swiglu" if mxfp4 else "silu")
    expected = reference_moe(x, index, weights, gate_up, down, layout["interleaved"], layout["activation"])
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    if format == "dense":  # stored [E, K, N] as gpt-oss keeps bf16 experts: [E, N, K] views of other strides
        gate_up, down = (PackedWeight("dense", w.data.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), None,
                                      w.bias) for w in (gate_up, down))
    actual = fused_moe(x.to(DEVICE, dtype), index.to(DEVICE), weights.to(DEVICE), gate_up, down, **layout)
    assert len(calls) == grouped_gemms and actual.dtype == dtype
    error = (actual.cpu().double() - expected).norm() / expected.norm()
    assert error <= (1e-4 if precision == "fp32" else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("dequantize", [True, False])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_experts_read_from_slot_pool_views_give_the_same_bits(monkeypatch, format, dequantize):
    """Experts as views over an offload slot pool (`BlobLayout.weights`: each expert's weights, scales and biases a
    blob apart, in slots other than their ids, ids routed through their slots) give the bits of the same experts
    stored one after another, on the fused launches and on `_dequantized_moe` (whose bias reads once assumed
    [E, N] contiguous biases: a pool's gave other experts' biases). The pool's call names its 4 experts
    (`routed_experts`): 24 pairs per routed expert, as the contiguous call estimates, not 16 over 6 slots, so with
    DEQUANTIZE_PAIRS 20 both calls dequantize; and the pool's dequantizes its 4 routed slots only, never the 2
    empty ones."""
    from dflash_compile.kernels import moe

    monkeypatch.setattr(moe, "DEQUANTIZE_PAIRS", dict.fromkeys(moe.DEQUANTIZE_PAIRS, 20 if dequantize else 1 << 20))
    paths, dequantized = [], []
    dequantized_moe, dequantize_experts = moe._dequantized_moe, moe._dequantize
    monkeypatch.setattr(moe, "_dequantized_moe", lambda *args: paths.append("dequantized") or dequantized_moe(*args))
    monkeypatch.setattr(moe, "_dequantize", lambda format, data, scales, out, ids=None: dequantized.append(
        out.shape[0]) or dequantize_experts(format, data, scales, out, ids))
    gate_up, down = _experts(format, 4, 160, 64, bias=True, seed=18)
    layout, blobs = _blobs(gate_up, down)
    slot_of = torch.tensor([4, 0, 5, 2])
    pool = torch.zeros(6, blobs.shape[1], dtype=blobs.dtype)
    pool[slot_of] = blobs
    pooled = layout.weights(pool.to(DEVICE), format)
    index, weights = _routing(48, 4, 2, seed=19)
    x = torch.randn(48, 160, generator=torch.Generator().manual_seed(20)).to(DEVICE)
    calls = dict(interleaved=True, activation="clamped_swiglu")
    expected = fused_moe(x, index.to(DEVICE), weights.to(DEVICE), gate_up, down, **calls)
    paths.clear(), dequantized.clear()
    actual = fused_moe(x, slot_of[index].to(DEVICE), weights.to(DEVICE), *pooled, routed_experts=4, **calls)
    assert torch.equal(actual, expected)
    assert paths == (["dequantized"] if dequantize else [])
    assert dequantized == ([4, 4] if dequantize and format != "dense" else [])  # gate/up, down: the routed slots


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the interpreter's bf16 is wrong"))])
@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_dequantize_kernel_gives_the_reference_dequantizers_bits(format, dtype):
    """`_dequantize` over a run of experts (N and K with partial 128-blocks), and over experts by id, is
    `PackedWeight.dequantize`."""
    from dflash_compile.kernels.moe import _dequantize

    weight, _ = _experts(format, 3, 352, 96, bias=False, seed=18)  # gate/up [3, 192, 352]
    out = torch.empty(2, 192, 352, dtype=dtype, device=DEVICE)
    _dequantize(format, weight.data[1:], weight.scales[1:], out)
    torch.testing.assert_close(out, weight.dequantize(dtype)[1:], atol=0, rtol=0)
    _dequantize(format, weight.data, weight.scales, out, torch.tensor([2, 0], dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(out, weight.dequantize(dtype)[[2, 0]], atol=0, rtol=0)  # experts by id


@pytest.mark.parametrize("format", ["fp8_block", "mxfp4"])
def test_packed_linear_matches_dequantize_then_matmul(format):
    """The dense-layer use of the kernel (every row on one expert, blocks of rows in order): N and K with partial
    128-blocks, 40 rows in three blocks of 16 (the last partial), K split over the rows as well."""
    from dflash_compile.kernels.moe import packed_linear

    generator = torch.Generator().manual_seed(5)
    weight = PackedWeight.quantize(torch.randn(1, 200, 352, generator=generator), format,
                                   torch.randn(1, 200, generator=generator))
    weight = PackedWeight(weight.format, weight.data.to(DEVICE), weight.scales.to(DEVICE), weight.bias.to(DEVICE))
    x = torch.randn(4, 10, 352, generator=generator)
    expected = x.double() @ weight.dequantize(torch.float64)[0].cpu().T + weight.bias[0].cpu().double()
    actual = packed_linear(x.to(DEVICE), weight)
    assert actual.shape == (4, 10, 200) and actual.dtype == x.dtype
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4
    torch.testing.assert_close(packed_linear(x.to(DEVICE), weight, split_k=3), actual, atol=1e-5, rtol=1e-5)
    for rows in (1, 2):  # a decode step's single row, a block of two (MXFP4: the CUDA-core path for both)
        for tiles in ({}, {"block_m": rows}):  # FP8 with pointer loads (fp32) when block_m asks for it
            few = packed_linear(x[:1, :rows].to(DEVICE), weight, **tiles)
            assert (few.cpu().double() - expected[:1, :rows]).norm() / expected[:1, :rows].norm() <= 1e-4


def test_fp8_dense_tiles_follow_rows_and_width():
    """FP8 dense layers' tensor-core tiles by rows and output width (`_dense_tiles`), the caller's tiles first, and
    blocks of 64 rows (above 64 rows) against the reference with a partial last block."""
    from dflash_compile.kernels.moe import _dense_tiles, packed_linear

    assert _dense_tiles(3, 576) == {"block_n": 32} and _dense_tiles(16, 7168) == {"block_n": 64}
    assert _dense_tiles(64, 7168) == {"block_n": 128} and _dense_tiles(64, 2048) == {"block_n": 64}
    assert _dense_tiles(256, 4096) == {"block_n": 128, "block_m": 64, "num_stages": 4}
    generator = torch.Generator().manual_seed(7)
    weight = PackedWeight.quantize(torch.randn(1, 200, 352, generator=generator), "fp8_block")
    weight = PackedWeight(weight.format, weight.data.to(DEVICE), weight.scales.to(DEVICE), None)
    x = torch.randn(100, 352, generator=generator)
    expected = x.double() @ weight.dequantize(torch.float64)[0].cpu().T
    actual = packed_linear(x.to(DEVICE), weight)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4
    torch.testing.assert_close(actual, packed_linear(x.to(DEVICE), weight, block_m=64, block_n=64), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the interpreter's bf16 is wrong"))])
@pytest.mark.parametrize("slab_elements", [1 << 25, 1])
def test_fp8_dense_layers_of_many_rows_dequantize_then_multiply(monkeypatch, slab_elements, dtype):
    """From DEQUANTIZE_ROWS rows an FP8 dense layer is dequantized by the kernel (the reference dequantizer's bits,
    slab by slab of 128 output rows when DEQUANTIZE_ELEMENTS is small, the last slab partial) and multiplied by
    torch: the same result as torch's linear on the reference's dense weight; with tiles given the fused launch
    runs instead, within tolerance."""
    from dflash_compile.kernels import moe

    monkeypatch.setattr(moe, "DEQUANTIZE_ELEMENTS", slab_elements)
    generator = torch.Generator().manual_seed(8)
    weight = PackedWeight.quantize(torch.randn(1, 200, 352, generator=generator), "fp8_block",
                                   torch.randn(1, 200, generator=generator))
    weight = PackedWeight(weight.format, weight.data.to(DEVICE), weight.scales.to(DEVICE), weight.bias.to(DEVICE))
    x = torch.randn(2, moe.DEQUANTIZE_ROWS // 2, 352, generator=generator).to(DEVICE, dtype)
    dense, bias = weight.dequantize(dtype)[0], weight.bias[0].to(dtype)
    slabs = [slice(0, 200)] if slab_elements > 200 * 352 else [slice(0, 128), slice(128, 200)]
    # torch's linear slab by slab too: cuBLAS may sum K in another order for another output width
    expected = torch.cat([torch.nn.functional.linear(x, dense[slab], bias[slab]) for slab in slabs], dim=-1)
    torch.testing.assert_close(moe.packed_linear(x, weight), expected, atol=0, rtol=0)
    fused = moe.packed_linear(x, weight, block_m=64)
    assert (fused.double() - expected.double()).norm() / expected.double().norm() <= (1e-4 if dtype == torch.float32
                                                                                     else 1e-2)


@pytest.mark.skipif(DEVICE == "cpu", reason="TMA loads and bf16 activations need the GPU")
def test_fp8_dense_layers_take_the_row_path_for_one_or_two_rows():
    """A decode step's single bf16 row, or a verify step's two, through an FP8 dense layer: the CUDA-core row path
    with TMA loads by default (the same bits as asking for block_m=1 / 2), within bf16 tolerance of the reference;
    three rows take the tensor-core tiles (the same bits as block_m=16)."""
    from dflash_compile.kernels.moe import packed_linear

    generator = torch.Generator().manual_seed(6)
    weight = PackedWeight.quantize(torch.randn(1, 300, 1024, generator=generator), "fp8_block")
    weight = PackedWeight(weight.format, weight.data.to(DEVICE), weight.scales.to(DEVICE), None)
    x = torch.randn(3, 1024, generator=generator).to(DEVICE, torch.bfloat16)
    expected = x.double() @ weight.dequantize(torch.float64)[0].T
    for rows in (1, 2):
        actual = packed_linear(x[:rows], weight)
        assert (actual.double() - expected[:rows]).norm() / expected[:rows].norm() <= 1e-2
        torch.testing.assert_close(actual, packed_linear(x[:rows], weight, block_m=rows, weight_loads="tma"),
                                   atol=0, rtol=0)
    torch.testing.assert_close(packed_linear(x, weight), packed_linear(x, weight, block_m=16), atol=0, rtol=0)


def test_bf16_dense_layers_take_the_row_path_for_one_row():
    """A decode step's single row through a dense layer (`dflash::split_k_linear`'s o_proj, router): the CUDA-core row
    path on DENSE_ROW_TILES (the same bits as asking for them), within tolerance of torch's linear; two rows take
    the tensor-core tiles (the same bits as block_m=16)."""
    from dflash_compile.kernels.moe import DENSE_ROW_TILES, packed_linear

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16  # the interpreter's bf16 is wrong
    generator = torch.Generator().manual_seed(9)
    weight, bias, x = (torch.randn(shape, generator=generator).to(DEVICE, dtype) for shape in ((40, 640), 40, (2, 640)))
    layer = PackedWeight("dense", weight[None], None, bias[None])
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    one = packed_linear(x[:1], layer)
    assert (one.double() - expected[:1]).norm() / expected[:1].norm() <= (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(one, packed_linear(x[:1], layer, block_m=1, **DENSE_ROW_TILES), atol=0, rtol=0)
    torch.testing.assert_close(packed_linear(x, layer), packed_linear(x, layer, block_m=16), atol=0, rtol=0)


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_fused_moe_reads_experts_from_a_slot_pool(format):
    """Offload's layout: every expert one byte blob in a pool row, each tensor a strided view over the slots."""
    gate_up, down = _experts(format, 4, 256, 64, bias=True, seed=6)
    layout, blobs = _blobs(gate_up, down)
    slot_of = torch.tensor([2, 0, 3, 1])  # expert e sits in slot slot_of[e]
    pool = torch.empty_like(blobs, device=DEVICE)
    pool[slot_of.to(DEVICE)] = blobs.to(DEVICE)
    pooled = layout.weights(pool, format)
    index, weights = _routing(3, 4, 2, seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    expected = reference_moe(x, index, weights, gate_up, down, False, "silu")
    actual = fused_moe(x.to(DEVICE), slot_of[index].to(DEVICE), weights.to(DEVICE), *pooled, compute_fp32=True)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 1e-4


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
def test_experts_without_a_slot_are_read_from_their_host_blobs(format):
    """slot_of: two of four experts in a slot pool, the other two read by the kernel from their host blobs (pinned
    memory read over PCIe on a GPU; on a CPU both are CPU memory), in one call, also in MXFP4's 128-row blocks (a
    prefill's); one token on the resident experts' path (the CUDA cores, dense rows too), so with the same bits;
    slot_of and host only together, with matching strides."""
    gate_up, down = _experts(format, 4, 256, 64, bias=True, seed=6)
    layout, host = _blobs(gate_up, down, pin_memory=DEVICE == "cuda")
    slot_of = torch.tensor([1, -1, 0, -1], dtype=torch.int32)  # experts 2 and 0 in slots 0 and 1, 1 and 3 on host
    pool = host[torch.tensor([2, 0])].to(DEVICE)
    index, weights = _routing(3, 4, 3, seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    expected = reference_moe(x, index, weights, gate_up, down, False, "silu")
    pooled, on_host = layout.weights(pool, format), layout.weights(host, format)
    wide = [(slice(0, 3), {"block_m": 128})] if format == "mxfp4" else []
    for rows, tiles in [(slice(0, 3), {})] + wide + [(slice(0, 1), {})]:  # one token: the CUDA-core path
        actual = fused_moe(x[rows].to(DEVICE), index[rows].to(DEVICE), weights[rows].to(DEVICE), *pooled,
                           compute_fp32=True, host=on_host, slot_of=slot_of.to(DEVICE), **tiles)
        assert (actual.cpu().double() - expected[rows]).norm() / expected[rows].norm() <= 1e-4
    resident = fused_moe(x[:1].to(DEVICE), index[:1].to(DEVICE), weights[:1].to(DEVICE), gate_up, down,
                         compute_fp32=True)
    assert torch.equal(actual, resident)  # the loop's last call
    with pytest.raises(ValueError, match="slot_of and host come together"):
        fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), *pooled, slot_of=slot_of.to(DEVICE))
    with pytest.raises(ValueError, match="the host weights must have the slot pool's strides"):
        fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, host=on_host,
                  slot_of=slot_of.to(DEVICE))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "deepseek_v3"])
def test_fused_kernel_on_a_modules_own_bf16_layout(tiny, family):
    """The resident experts' parameters as they are (gpt-oss: [E, in, out], read through a transposed view at its
    strides) give the module's own forward."""
    from dflash_compile.expert_store import Gate
    from dflash_compile.families import FAMILIES, experts_modules
    from dflash_compile.packed import expert_weights

    model = tiny(family).to(DEVICE)
    experts = next(iter(experts_modules(model).values()))
    gate = Gate.of(FAMILIES[family].layout, experts)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    index, weights = (t.to(DEVICE) for t in _routing(5, experts.gate_up_proj.shape[0], 2, seed=1))
    expected = experts(hidden, index, weights)
    gate_up, down = expert_weights(experts)
    actual = fused_moe(hidden, index, weights, gate_up, down, interleaved=gate.interleaved,
                       activation=gate.activation, alpha=gate.alpha, limit=gate.limit, compute_fp32=True)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def _tiled_calls(format, family, precision):
    """A family's experts, routing and activations for calls with tile overrides: `run(rows, **tiles)`, the fused
    call on those tokens as fp64 on the CPU, `reference(rows)` the definition's, the call's relative tolerance, and
    the token count."""
    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES[family]
    gate_up, down = _experts(format, experts, hidden, inter, bias)
    if precision == "bf16" and format == "dense":
        gate_up, down = (PackedWeight("dense", w.data.bfloat16(), None, w.bias) for w in (gate_up, down))
    index, weights = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    run = lambda rows, **tiles: fused_moe(x[rows].to(DEVICE, dtype), index[rows].to(DEVICE),  # noqa: E731
                                          weights[rows].to(DEVICE), gate_up, down, interleaved=interleaved,
                                          activation=activation, **tiles).cpu().double()
    reference = lambda rows: reference_moe(x[rows], index[rows], weights[rows], gate_up, down,  # noqa: E731
                                           interleaved, activation)
    return run, reference, 1e-4 if precision == "fp32" else 1e-2, tokens


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("family, split_k", [("gpt_oss_short", 3), ("silu_concatenated", 2)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_token_split_over_k_matches_the_reference(format, family, split_k, precision):
    """split_k: one token's launches split K into shares whose partial sums are added afterwards (gpt-oss's layout
    at K = 608: 5 K steps of 128 in shares of 2, 2 and 1, MXFP4's 3 steps of 256 in 1, 1 and 1, biases added once,
    clamped SwiGLU after the sum; K = 96 < block_k, so the second share is empty). The reference's result and, to
    rounding, the unsplit kernel's; a batch does not split."""
    run, reference, tolerance, tokens = _tiled_calls(format, family, precision)
    expected = reference(slice(0, 1))
    split = run(slice(0, 1), split_k=split_k)
    assert (split - expected).norm() / expected.norm() <= tolerance
    unsplit = run(slice(0, 1))  # the same sums in another order round differently (fp32: 1.2e-6 on the H200)
    assert (split - unsplit).norm() / expected.norm() <= (1e-5 if precision == "fp32" else 1e-2)
    torch.testing.assert_close(run(slice(0, tokens), split_k=split_k), run(slice(0, tokens)), atol=0, rtol=0)


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("family", ["gpt_oss_short", "silu_concatenated"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_down_launch_takes_tiles_of_its_own(format, family, precision):
    """Tile `down_launch`: one token's down launch with narrower columns, other warps, 64-wide K steps and 2 shares
    of K (the second empty for gpt-oss's K = 32) while the gate/up launch keeps its tiles, unsplit: the reference's
    result, to rounding the default's; the same for a batch (which never splits); settings the down launch cannot
    take alone are named."""
    run, reference, tolerance, tokens = _tiled_calls(format, family, precision)
    own = {"block_n": 16, "block_k": 64, "num_warps": 2, "split_k": 2}
    expected = reference(slice(0, 1))
    apart = run(slice(0, 1), down_launch=own)
    assert (apart - expected).norm() / expected.norm() <= tolerance
    assert (apart - run(slice(0, 1))).norm() / expected.norm() <= (1e-5 if precision == "fp32" else 1e-2)
    batch = reference(slice(0, tokens))
    assert (run(slice(0, tokens), down_launch=own) - batch).norm() / batch.norm() <= tolerance
    with pytest.raises(ValueError, match=r"unknown down tile settings \['block_m'\]; the down launch takes its own"):
        run(slice(0, 1), down_launch={"block_m": 2})
    with pytest.raises(ValueError, match="split_k must be a positive integer"):
        run(slice(0, 1), down_launch={"split_k": 0})


def test_split_k_with_fp16_operands_and_in_a_dense_layer():
    """The shares' sum meets the fp16 prescale (FP8, fp16 operands: gate/up's finishing launch writes the down
    launch's prescaled fp16 activations) and packed_linear's single row (its shares added by the pair sum)."""
    from dflash_compile.kernels.moe import packed_linear

    experts, hidden, inter, top_k, tokens, interleaved, activation, bias = FAMILY_CASES["gpt_oss"]
    gate_up, down = _experts("fp8_block", experts, hidden, inter, bias)
    index, weights = _routing(1, experts, top_k)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    expected = reference_moe(x, index, weights, gate_up, down, interleaved, activation)
    actual = fused_moe(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), gate_up, down, interleaved=interleaved,
                       activation=activation, compute_fp32=False, operands="fp16", split_k=4, block_m=16)
    assert (actual.cpu().double() - expected).norm() / expected.norm() <= 2e-3
    weight = PackedWeight(gate_up.format, gate_up.data[:1], gate_up.scales[:1], gate_up.bias[:1])
    row = x.to(DEVICE)
    torch.testing.assert_close(packed_linear(row, weight, split_k=5), packed_linear(row, weight), atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"split_k must be a positive integer \(shares of K\), got 0"):
        packed_linear(row, weight, split_k=0)


@pytest.mark.parametrize("layer, n, k, best", [
    ("qwen3-30b-a3b o_proj", 2048, 4096, 8), ("gpt-oss-20b router", 32, 2880, 23),
    ("qwen3-30b-a3b router", 128, 2048, 16), ("deepseek-v3 o_proj", 7168, 16384, 4),
    ("deepseek-v3 dense down_proj", 7168, 18432, 4), ("gpt-oss-20b o_proj", 2880, 4096, 5),
    ("deepseek-v3 q_a_proj", 1536, 7168, 11), ("deepseek-v3 kv_a_proj_with_mqa", 576, 7168, 14)])
def test_a_bf16_rows_shares_on_an_h200_are_the_measured_best(layer, n, k, best):
    """A bf16 linear's single row (`split_k_linear`) on the H200's 132 SMs takes the share count that measured
    fastest there (bench/packed_linear.py --format dense --tokens 1, sessions 46 and 50), and no shares without SMs."""
    from dflash_compile.kernels.moe import DENSE_ROW_TILES, ROW_TILES, _filling_splits, _share_steps

    block_k = ROW_TILES["dense"]["pointers"][1]["block_k"]
    steps = _share_steps("dense", 1, DENSE_ROW_TILES["block_n"])
    programs, warps = triton.cdiv(n, DENSE_ROW_TILES["block_n"]), DENSE_ROW_TILES["num_warps"]
    assert _filling_splits(programs, triton.cdiv(k, block_k), 132, steps, warps) == best
    assert _filling_splits(programs, triton.cdiv(k, block_k), None, steps, warps) == 1


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block", "dense"])
@pytest.mark.parametrize("tiles", [{}, {"down_launch": {"split_k": 2}}])
def test_one_tokens_down_launch_sums_its_pairs_itself(monkeypatch, format, tiles):
    """One token's down launch adds the token's pairs (and K shares) itself, no `_sum_pairs` launch: the program
    that brings a column tile's arrival count to top-k x shares sums them in `_sum_pairs`' order, so the bits are
    those of the separate sum (taken when the counts are out of reach, `arrivals.SIZE`, and for blocks grouped by
    expert); the counts are zero again after each call, and a dense layer's K shares are summed the same way."""
    from dflash_compile.kernels import arrivals, moe

    run, reference, tolerance, tokens = _tiled_calls(format, "silu_concatenated", "fp32")  # 3 tokens, top-2
    weight = _experts(format, 1, 96, 64, False)[0]
    rows = torch.randn(2, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    separate_sum = moe._sum_pairs

    def no_separate_sum(*args):
        raise AssertionError("the launch should have summed its pairs itself")

    monkeypatch.setattr(moe, "_sum_pairs", no_separate_sum)
    in_launch, dense = run(slice(0, 1), **tiles), moe.packed_linear(rows, weight, split_k=3)
    expected = reference(slice(0, 1))
    assert (in_launch - expected).norm() / expected.norm() <= tolerance
    assert arrivals._COUNTS[rows.device].count_nonzero() == 0
    with pytest.raises(AssertionError, match="should have summed"):  # a batch's blocks grouped by expert
        run(slice(0, tokens))
    monkeypatch.setattr(moe, "_sum_pairs", separate_sum)
    monkeypatch.setattr(arrivals, "SIZE", 0)
    assert torch.equal(run(slice(0, 1), **tiles), in_launch)
    assert torch.equal(moe.packed_linear(rows, weight, split_k=3), dense)


def test_arrival_counts_are_not_made_while_a_graph_is_captured(monkeypatch):
    """Zeroing the counts during a CUDA-graph capture would only be recorded, not done: no counts then (the call
    sums by `_sum_pairs`), and none kept for later calls."""
    from dflash_compile.kernels import arrivals

    monkeypatch.setattr(arrivals, "_COUNTS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert arrivals.arrival_counts(torch.device("cuda", 0), 10) is None
    assert arrivals._COUNTS == {}


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs")
def test_one_token_calls_replayed_from_cuda_graphs(monkeypatch):
    """A graph captured before any arrival counts exist sums by `_sum_pairs`; one captured over the counts sums in
    its down launch and leaves them zeroed after every replay: both replay the eager result, bit for bit."""
    from dflash_compile.kernels import arrivals

    gate_up, down = _experts("fp8_block", 4, 256, 128, False)
    index, weights = (t.to(DEVICE) for t in _routing(1, 4, 2, seed=4))  # no host copies inside a capture
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    call = lambda: fused_moe(x, index, weights, gate_up, down)  # noqa: E731
    counts = arrivals.SIZE
    monkeypatch.setattr(arrivals, "_COUNTS", {})
    monkeypatch.setattr(arrivals, "SIZE", 0)
    expected = call()  # compiles the separate sum's kernels before the capture
    arrivals._COUNTS.clear()  # the first graph is captured before any counts exist
    monkeypatch.setattr(arrivals, "SIZE", counts)
    graphs, outs = [torch.cuda.CUDAGraph() for _ in range(2)], []
    for graph in graphs:
        if outs:
            torch.testing.assert_close(call(), expected, atol=0, rtol=0)  # makes the counts, compiles the sum
        with torch.cuda.graph(graph):
            outs.append(call())
    for _ in range(3):
        for graph, out in zip(graphs, outs):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert arrivals._COUNTS[x.device].count_nonzero() == 0
