"""dflash::moe_dispatch: schema/fake/autograd checks and exactness against each family's own Experts module."""

import pytest
import torch

from dflash_compile.expert_store import ExpertStore, get_store
from dflash_compile.families import FAMILIES, experts_modules
from tests.conftest import FAMILIES as FAMILY_NAMES


def _routed(model):
    """The first MoE layer's routed experts."""
    return next(iter(experts_modules(model).values()))


def _routing(experts, tokens=11, top_k=3, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, experts.down_proj.shape[2 if experts.is_transposed else 1], generator=generator)
    scores = torch.rand(tokens, experts.down_proj.shape[0], generator=generator)
    weights, index = scores.topk(top_k, dim=-1)
    return hidden.to(dtype), index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


# Ergo's experts take one (token, route) row a route, at weight 1: its MoE block norms each route's output between
ONE_ROUTE_A_ROW = ("ergo",)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_equals_the_family_experts_module(tiny, family):
    """The store's math against transformers' eager experts loop (the family's own definition) in fp32."""
    experts = _routed(tiny(family, experts_implementation="eager"))
    store = ExpertStore()
    layer = store.add_layer(experts, FAMILIES[family], "experts")
    hidden, index, weights = _routing(experts)
    if family in ONE_ROUTE_A_ROW:
        hidden, index = hidden.repeat_interleave(index.shape[1], dim=0), index.reshape(-1, 1)
        weights = torch.ones_like(index, dtype=hidden.dtype)
    with torch.no_grad():
        expected = experts(hidden, index, weights)
        actual = torch.ops.dflash.moe_dispatch(hidden, index, weights, store.id, layer)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_offloaded_dispatch_is_kept_out_of_cuda_graphs():
    assert torch.Tag.cudagraph_unsafe in torch.ops.dflash.moe_dispatch_offloaded.default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.dflash.moe_dispatch.default.tags


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_opcheck_moe_dispatch(tiny, family):
    experts = _routed(tiny(family))
    store = ExpertStore()
    layer = store.add_layer(experts, FAMILIES[family], "experts")
    for tokens in (1, 5):
        hidden, index, weights = _routing(experts, tokens=tokens)
        torch.library.opcheck(torch.ops.dflash.moe_dispatch.default, (hidden, index, weights, store.id, layer))
        torch.library.opcheck(torch.ops.dflash.moe_dispatch_offloaded.default,
                              (hidden, index, weights, store.id, layer))


def test_fake_checks_routing_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match="top_k_index and top_k_weights differ in shape"):
        torch.ops.dflash.moe_dispatch(torch.empty(4, 8), torch.empty(4, 2, dtype=torch.long), torch.empty(4, 3), 0, 0)


def test_store_reads_live_weights_and_reports_freed_models(tiny):
    model = tiny("olmoe")
    experts = _routed(model)
    store = ExpertStore()
    layer = store.add_layer(experts, FAMILIES["olmoe"], "layers.0.mlp.experts")
    assert store.add_layer(experts, FAMILIES["olmoe"], "again") == layer  # one handle per module
    hidden, index, weights = _routing(experts)
    with torch.no_grad():
        before = store.dispatch(layer, hidden, index, weights)
        experts.down_proj.mul_(2)  # weights changed in place are seen: the store does not copy them
        torch.testing.assert_close(store.dispatch(layer, hidden, index, weights), 2 * before)
    del model, experts
    with pytest.raises(RuntimeError, match=r"layers.0.mlp.experts was freed while a compiled graph still uses it"):
        store.dispatch(layer, hidden, index, weights)
    store_id = store.id
    del store
    with pytest.raises(RuntimeError, match=rf"expert store {store_id} no longer exists"):
        get_store(store_id)


def test_layout_mismatch_with_the_registry_is_reported(tiny):
    experts = _routed(tiny("gpt_oss"))
    with pytest.raises(ValueError, match=r"GptOssExperts.is_concatenated is False, but the family registry's layout"):
        ExpertStore().add_layer(experts, FAMILIES["mixtral"], "experts")


def test_opcheck_kv_ops():
    caches = torch.randn(2, 3, 16, 4), torch.randn(2, 3, 16, 6)  # value head_dim differs (DeepSeek)
    new = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 6)
    lengths = torch.tensor([0, 7])
    torch.library.opcheck(torch.ops.dflash.kv_write.default, (*caches, *new, lengths))
    torch.library.opcheck(torch.ops.dflash.kv_write.default, (caches[0], None, new[0], None, lengths))  # keys alone
    torch.library.opcheck(torch.ops.dflash.kv_commit.default, (lengths.clone(), torch.tensor([2, 0])))


def test_opcheck_top_k():
    """The top k of the scores, and (a router's steps given) of their softmax, renormalized and cast, as torch
    computes them on a CPU."""
    scores = torch.randn(2, 3, 32)
    torch.library.opcheck(torch.ops.dflash.top_k.default, (scores, 4))
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.dflash.top_k(scores, 4), torch.topk(scores, 4)))
    logits = scores.bfloat16()
    torch.library.opcheck(torch.ops.dflash.top_k.default, (logits, 4, torch.float32, True, torch.bfloat16))
    values, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), 4)
    values /= values.sum(dim=-1, keepdim=True)
    actual = torch.ops.dflash.top_k(logits, 4, torch.float32, True, torch.bfloat16)
    assert torch.equal(actual[0], values.bfloat16()) and torch.equal(actual[1], indices)


def test_top_k_rejects_k_beyond_the_row_at_trace_time():
    with pytest.raises(RuntimeError, match=r"top_k: k = 9 exceeds the last dimension \(8\)"):
        torch.compile(lambda x: torch.ops.dflash.top_k(x, 9), backend="aot_eager", fullgraph=True)(torch.randn(2, 8))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("seen", [None, 15])
def test_opcheck_decode_attention(device, sinks, seen):
    """torch's math on a CPU, the Triton kernel on CUDA (bf16, within `decode_kernel_takes`' limits); with `seen`,
    the slots from it on hidden from every row."""
    from dflash_compile.attention import decode_kernel_takes, folded_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 8, 16, generator=generator).transpose(1, 2).to(device, dtype)
    key, value = (torch.randn(1, 2, 20, 16, generator=generator).to(device, dtype) for _ in range(2))
    mask = torch.where(torch.rand(1, 1, 2, 20, generator=generator) > 0.3, 0.0, -1e4).to(device, dtype)
    if seen is not None:
        mask[..., seen:] = torch.finfo(dtype).min
    sink_logits = torch.randn(8, generator=generator).to(device, dtype) if sinks else None
    assert decode_kernel_takes(query, key, value, mask) == (device == "cuda")
    args = (query, key, value, mask, sink_logits, 0.25, None if seen is None else torch.tensor(seen, device=device))
    torch.library.opcheck(torch.ops.dflash.decode_attention.default, args)
    torch.testing.assert_close(torch.ops.dflash.decode_attention(*args), folded_attention(*args[:6]),
                               rtol=2e-2 if device == "cuda" else 0, atol=2e-2 if device == "cuda" else 0)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("rows, k, n", [(1, 2880, 32), (16, 4096, 2880)])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_split_k_linear(device, rows, k, n, bias):
    """torch's linear on a CPU; on CUDA in bf16 the packed-linear kernel (K split, the shares added in its launch),
    against the fp32 product: gpt-oss-20b's router for one token and its o_proj for a verify block of 16."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) * k ** -0.5
    bias_or_none = torch.randn(n, generator=generator) if bias else None
    args = [t if t is None else t.to(device, dtype) for t in (x, weight, bias_or_none)]
    torch.library.opcheck(torch.ops.dflash.split_k_linear.default, args)
    out = torch.ops.dflash.split_k_linear(*args)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = torch.nn.functional.linear(*[t if t is None else t.float() for t in args])
    torch.testing.assert_close(out.float(), expected.to(device), rtol=1e-2 if device == "cuda" else 1e-5,
                               atol=1e-2 if device == "cuda" else 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA")
def test_split_k_linear_leaves_fp16_to_torch():
    """fp16 runs torch's linear, bit for bit: the kernel's dense tiles multiply bf16 operands."""
    x, weight = (torch.randn(shape, device="cuda", dtype=torch.float16) for shape in ((1, 2880), (32, 2880)))
    assert torch.equal(torch.ops.dflash.split_k_linear(x, weight, None), torch.nn.functional.linear(x, weight))


def test_kv_write_writes_each_row_at_its_length_and_commit_moves_only_lengths():
    keys, values = torch.zeros(2, 1, 8, 1), torch.zeros(2, 1, 8, 1)
    new = torch.arange(1.0, 4.0).view(1, 1, 3, 1).repeat(2, 1, 1, 1)
    lengths = torch.tensor([0, 4])
    torch.ops.dflash.kv_write(keys, values, new, -new, lengths)
    assert keys[0, 0, :, 0].tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert keys[1, 0, :, 0].tolist() == [0, 0, 0, 0, 1, 2, 3, 0]
    assert values[1, 0, :, 0].tolist() == [0, 0, 0, 0, -1, -2, -3, 0]
    torch.ops.dflash.kv_commit(lengths, torch.tensor([1, 3]))
    assert lengths.tolist() == [1, 7]


def test_greedy_accept_by_exhaustive_enumeration():
    """Every draft of length 3 over a 3-token vocabulary against fixed target logits: the accepted count is the
    longest prefix of drafts equal to the target argmax, and the committed tokens are the argmax up to it."""
    import itertools

    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))[None]  # positions 0..3
    target = logits.argmax(-1)[0].tolist()
    for drafts in itertools.product(range(3), repeat=3):
        block = torch.tensor([[1, *drafts]])
        accepted, argmax = torch.ops.dflash.greedy_accept(block, logits)
        expected = 0
        while expected < 3 and drafts[expected] == target[expected]:
            expected += 1
        assert accepted.item() == expected and argmax[0].tolist() == target
    batch = torch.tensor([[1, target[0], 0 if target[1] else 1, target[2]], [1, *target[:3]]])
    torch.library.opcheck(torch.ops.dflash.greedy_accept.default, (batch, logits.repeat(2, 1, 1)))
    assert torch.ops.dflash.greedy_accept(batch, logits.repeat(2, 1, 1))[0].tolist() == [1, 3]


def test_linear_state_commit_ops():
    state = torch.zeros(2, 3, 4)
    full = torch.arange(2 * 3 * 10, dtype=torch.float32).view(2, 3, 10)  # old window (4) + a 6-token block
    torch.library.opcheck(torch.ops.dflash.conv_window_commit.default, (state.clone(), full, torch.tensor([7, 4])))
    torch.ops.dflash.conv_window_commit(state, full, torch.tensor([7, 4]))  # row 0 keeps 3 tokens, row 1 none
    assert torch.equal(state[0], full[0, :, 3:7]) and torch.equal(state[1], full[1, :, 0:4])
    ids, history = torch.zeros(2, 2, dtype=torch.long), torch.arange(2 * 5).view(2, 5)  # a state of token ids
    torch.library.opcheck(torch.ops.dflash.conv_window_commit.default, (ids.clone(), history, torch.tensor([5, 2])))
    torch.ops.dflash.conv_window_commit(ids, history, torch.tensor([5, 2]))
    assert ids.tolist() == [[3, 4], [5, 6]]
    recurrent, candidate = torch.zeros(2, 2, 2), torch.ones(2, 2, 2)
    torch.library.opcheck(torch.ops.dflash.state_select.default, (recurrent.clone(), candidate, torch.tensor([1, 0])))
    torch.ops.dflash.state_select(recurrent, candidate, torch.tensor([True, False]))
    assert recurrent[0].eq(1).all() and recurrent[1].eq(0).all()


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_opcheck_packed_moe(format):
    """The op a packed experts module runs: its result equals the dequantized reference, and opcheck passes."""
    from dflash_compile.expert_store import Gate, run_packed
    from dflash_compile.packed import PackedWeight

    generator = torch.Generator().manual_seed(0)
    gate_up = PackedWeight.quantize(torch.randn(3, 64, 32, generator=generator), format,
                                    torch.randn(3, 64, generator=generator))
    down = PackedWeight.quantize(torch.randn(3, 32, 32, generator=generator), format, None)
    hidden, index = torch.randn(4, 32, generator=generator), torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0]])
    weights = torch.rand(4, 2, generator=generator)
    args = (hidden, index, weights, format, gate_up.data, gate_up.scales, gate_up.bias, down.data, down.scales,
            None, True, "clamped_swiglu", 1.702, 7.0)
    torch.library.opcheck(torch.ops.dflash.packed_moe.default, args)
    gate = Gate(True, "clamped_swiglu")
    expected = torch.zeros(4, 32)
    for t in range(4):
        for slot in range(2):
            e = int(index[t, slot])
            h = gate(hidden[t] @ gate_up.dequantize()[e].T + gate_up.bias[e])
            expected[t] += weights[t, slot] * (h @ down.dequantize()[e].T)
    torch.testing.assert_close(torch.ops.dflash.packed_moe(*args), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run_packed(hidden, index, weights, gate_up, down, gate), expected, atol=1e-5, rtol=1e-5)


def test_opcheck_fp8_block_linear():
    from dflash_compile.quant import dequantize_fp8_block, quantize_fp8_block

    generator = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8_block(torch.randn(130, 70, generator=generator))
    x, bias = torch.randn(4, 70, generator=generator), torch.randn(130, generator=generator)
    args = (x, weight.view(torch.uint8), scale, bias)
    torch.library.opcheck(torch.ops.dflash.fp8_block_linear.default, args)
    expected = torch.nn.functional.linear(x, dequantize_fp8_block(weight, scale), bias)
    torch.testing.assert_close(torch.ops.dflash.fp8_block_linear(*args), expected)


def test_each_familys_experts_activation_is_read_from_its_experts_module(tiny):
    """The experts' own `act_fn`, whatever config field built it: Gemma 4's `hidden_activation` (GELU, tanh
    approximation), the others' `hidden_act`, Aria's SiLU whatever `hidden_act` says, HY V4's SiLU of its clamped
    gate at its `swiglu_limit` (no `act_fn`); an activation the kernels do not have is refused with its name."""
    from dflash_compile.expert_store import Gate

    gemma = next(iter(experts_modules(tiny("gemma4_text")).values()))
    assert Gate.of(FAMILIES["gemma4_text"].layout, gemma) == Gate(False, "gelu_tanh")
    qwen = next(iter(experts_modules(tiny("qwen3_moe")).values()))
    assert Gate.of(FAMILIES["qwen3_moe"].layout, qwen) == Gate(False, "silu")
    aria = next(iter(experts_modules(tiny("aria")).values()))
    aria.config.hidden_act = "gelu_pytorch_tanh"  # its shared experts' activation, not the routed ones'
    assert Gate.of(FAMILIES["aria"].layout, aria) == Gate(False, "silu")
    hy = next(iter(experts_modules(tiny("hy_v4")).values()))
    assert Gate.of(FAMILIES["hy_v4"].layout, hy) == Gate(False, "clamped_gate_silu", limit=0.5)
    qwen.act_fn = torch.nn.ReLU()
    with pytest.raises(ValueError, match=r"^Qwen3MoeExperts uses the activation ReLU; dflash-compile's experts "
                                         r"support \['GELUTanh', 'SiLU', 'SiLUActivation', 'silu'\] \(and gpt-oss's "
                                         r"clamped SwiGLU\)$"):
        Gate.of(FAMILIES["qwen3_moe"].layout, qwen)
