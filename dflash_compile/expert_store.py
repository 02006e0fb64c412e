"""The expert store: owner of a model's routed-expert weights, looked up by integer handles from the graph.

After `expert_dispatch`, a compiled graph holds `dflash::moe_dispatch(hidden, top_k_index, top_k_weights, store,
layer)` nodes and no expert weights. The two integers name an `ExpertStore` (one per compiled root module) and a
layer inside it. Where a layer's weights live (the model's own parameters for now; pinned host blobs and a GPU slot
pool with offload) is the store's business, never the graph's.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import GELUTanh, ReLUSquaredActivation, SiLUActivation
from transformers.integrations.moe import grouped_mm_experts_forward

from .families import ExpertLayout, FamilySpec, first_projection
from .packed import PackedWeight, expert_weights, packed_weights

_store_ids = itertools.count()
_STORES_BY_ID: weakref.WeakValueDictionary[int, ExpertStore] = weakref.WeakValueDictionary()
_STORES_BY_ROOT: weakref.WeakKeyDictionary[torch.nn.Module, ExpertStore] = weakref.WeakKeyDictionary()

# The flags `@use_experts_implementation` puts on every experts module, and the registry's answer for each.
_DECLARED_FLAGS = {
    "is_concatenated": lambda layout: layout.gate_up != "interleaved",  # transformers' default for ungated ones
    "is_transposed": lambda layout: layout.transposed,
    "has_bias": lambda layout: layout.bias,
    "has_gate": lambda layout: layout.gate_up != "ungated",
}


def _check_layout(module: torch.nn.Module, spec: FamilySpec) -> None:
    """Fail loudly when transformers' own declaration of the experts disagrees with the family registry."""
    for flag, expected in _DECLARED_FLAGS.items():
        declared = getattr(module, flag, None)
        if declared is not None and declared != expected(spec.layout):
            raise ValueError(
                f"{type(module).__name__}.{flag} is {declared}, but the family registry's layout for "
                f"{spec.name!r} implies {expected(spec.layout)}; update FAMILIES in dflash_compile/families.py."
            )


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


def expert_sum(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
               expert_mlp) -> torch.Tensor:
    """The reference routed-experts loop: each routed expert's `expert_mlp(expert, its tokens)` times the routing
    weight, accumulated in fp32. Ids >= num_experts (expert-parallel sentinels) are not local experts."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in top_k_index.unique().tolist():
        if expert >= num_experts:
            continue
        token, slot = torch.where(top_k_index == expert)
        out.index_add_(0, token, (expert_mlp(expert, hidden[token]) * top_k_weights[token, slot, None]).float())
    return out.to(hidden.dtype)


# the experts' `act_fn`: the module transformers' ACT2FN builds from the config (`hidden_act`, Gemma's
# `hidden_activation`; Aria's experts always SiLU), by its class, or a function (LFM2-MoE's F.silu) -> the kernels'
# activation
GATED_ACTIVATIONS = {SiLUActivation: "silu", torch.nn.SiLU: "silu", F.silu: "silu", GELUTanh: "gelu_tanh"}
# likewise for experts without a gate (`ExpertLayout.gate_up` "ungated"): act(up), Nemotron-H's squared ReLU
UNGATED_ACTIVATIONS = {ReLUSquaredActivation: "relu2"}


@dataclass(frozen=True)
class Gate:
    """The gated activation of a family's experts: gate/up split (interleaved or concatenated) and the activation,
    SiLU(gate) * up, GELU(gate) * up with GELU's tanh approximation (Gemma 4), gpt-oss's clamped SwiGLU with
    `alpha` / `limit`, Step 3.7's SiLU(gate) <= `limit` times up clamped to [-`limit`, `limit`], or HY V4's SiLU of the
    gate clamped from above at `limit` times up clamped as Step 3.7's, or Inkling 2's softcap(gate, `alpha`) times
    sigmoid(gate) times softcap(up, `limit`) (softcap(x, c) = tanh(x / c) c); or of experts
    without a gate, relu(up)^2 (Nemotron-H, "relu2": the projection is up alone). The fused kernels take the same
    fields."""

    interleaved: bool
    activation: str  # "silu" | "gelu_tanh" | "clamped_swiglu" | "clamped_silu" | "clamped_gate_silu" | "relu2" |
    # "softcapped_swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, layout: ExpertLayout, module: torch.nn.Module) -> Gate:
        interleaved = layout.gate_up == "interleaved"
        if layout.activation == "clamped_swiglu":  # MiniMax-M3's experts name their alpha `swiglu_alpha`
            alpha = module.alpha if hasattr(module, "alpha") else module.swiglu_alpha
            return cls(interleaved, "clamped_swiglu", float(alpha), float(module.limit))
        if layout.activation == "clamped_gate_silu":  # HY V4's `swiglu_limit`, DeepSeek-V4's `limit`
            limit = module.swiglu_limit if hasattr(module, "swiglu_limit") else module.limit
            return cls(interleaved, "clamped_gate_silu", limit=float(limit))
        if layout.activation == "softcapped_swiglu":  # Inkling 2's: the gate's softcap in `alpha`, up's in `limit`
            return cls(interleaved, "softcapped_swiglu", float(module.act_fn.gate_softcap.softcap),
                       float(module.act_fn.up_softcap.softcap))
        act = module.act_fn if not isinstance(module.act_fn, torch.nn.Module) else type(module.act_fn)
        if layout.gate_up == "ungated":
            if act not in UNGATED_ACTIVATIONS:
                supported = [known.__name__ for known in UNGATED_ACTIVATIONS]
                raise ValueError(f"{type(module).__name__} uses the activation {act.__name__} without a gate; "
                                 f"dflash-compile's ungated experts support {supported}")
            return cls(False, UNGATED_ACTIVATIONS[act])
        if act not in GATED_ACTIVATIONS:
            supported = sorted({known.__name__ for known in GATED_ACTIVATIONS})
            raise ValueError(f"{type(module).__name__} uses the activation {act.__name__}; dflash-compile's experts "
                             f"support {supported} (and gpt-oss's clamped SwiGLU)")
        limit = getattr(module, "limit", None) if layout.activation == "clamped_act_fn" else None
        if limit is None or math.isinf(limit):  # a layer without clamps (transformers 5.24: inf; 5.25: None)
            return cls(interleaved, GATED_ACTIVATIONS[act])
        if GATED_ACTIVATIONS[act] != "silu":
            raise ValueError(f"{type(module).__name__} clamps its activation {act.__name__}; dflash-compile's "
                             "experts clamp SiLU only")
        return cls(interleaved, "clamped_silu", limit=float(limit))

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] gate/up projection (ungated: [..., I] up) -> [..., I]."""
        if self.activation == "relu2":
            return torch.relu(gate_up).square()
        gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
        if self.activation == "clamped_swiglu":
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        if self.activation == "clamped_silu":
            return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)
        if self.activation == "clamped_gate_silu":
            return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        if self.activation == "softcapped_swiglu":
            return _softcap(gate, self.alpha) * torch.sigmoid(gate) * _softcap(up, self.limit)
        return F.silu(gate) * up


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap: x bounded smoothly to (-cap, cap)."""
    return torch.tanh(x / cap) * cap


FUSED_DTYPES = (torch.bfloat16, torch.float32)  # what the fused kernels compute in (fp16 would round to bf16)


def run_packed(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: PackedWeight,
               down: PackedWeight, gate: Gate, cpu_kernels: bool = True) -> torch.Tensor:
    """Routed experts on packed weights: the fused Triton kernel on CUDA (`reference_packed` on GPUs it cannot run
    the format on: FP8 before compute capability 8.9, `fused_blocker`); on a CPU the C++ kernel of
    `dflash::packed_moe` (csrc/) or, where it cannot be built or `cpu_kernels` is False (that op's own Python
    kernel, which must not re-enter the op), `reference_packed`."""
    devices = {t.device for t in (hidden, top_k_index, top_k_weights, gate_up.data, down.data)}
    if len(devices) > 1:
        raise ValueError(f"routed experts on {gate_up.data.device}/{down.data.device} but hidden states on "
                         f"{hidden.device} and routing on {top_k_index.device}: move them to one device")
    if hidden.is_cuda:
        from .kernels.moe import fused_blocker, fused_moe

        blocker = fused_blocker(gate_up.format, hidden.device, hidden.dtype == torch.float32)
        if blocker:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{blocker}, so these experts run the reference path, which reads the routing on "
                                   "the host and cannot be captured in a CUDA graph: compile with mode='default' (no "
                                   "CUDA graphs) on this GPU")
            return reference_packed(hidden, top_k_index, top_k_weights, gate_up, down, gate)
        return fused_moe(hidden, top_k_index, top_k_weights, gate_up, down, interleaved=gate.interleaved,
                         activation=gate.activation, alpha=gate.alpha, limit=gate.limit)
    from .kernels import cpu

    if cpu_kernels and cpu.load():
        return torch.ops.dflash.packed_moe(hidden, top_k_index, top_k_weights, gate_up.format, gate_up.data,
                                           gate_up.scales, gate_up.bias, down.data, down.scales, down.bias,
                                           gate.interleaved, gate.activation, gate.alpha, gate.limit)
    return reference_packed(hidden, top_k_index, top_k_weights, gate_up, down, gate)


def reference_packed(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: PackedWeight, down: PackedWeight, gate: Gate) -> torch.Tensor:
    """The definition: each routed expert dequantized to fp32 (reference dequantizers) and its MLP in fp32."""

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = gate_up.select([expert]), down.select([expert])
        h = F.linear(x.float(), w1.dequantize()[0], None if w1.bias is None else w1.bias[0].float())
        return F.linear(gate(h), w2.dequantize()[0], None if w2.bias is None else w2.bias[0].float())

    return expert_sum(hidden, top_k_index, top_k_weights, gate_up.shape[0], expert_mlp)


@dataclass
class ResidentExperts:
    """One MoE layer's routed experts, read from the live module (so `.to()` and weight reloads are seen)."""

    module_ref: weakref.ReferenceType
    layout: ExpertLayout
    name: str
    fused: bool = False  # bf16 / fp32 weights run dflash's fused kernel in place, not transformers' experts path

    @property
    def module(self) -> torch.nn.Module:
        module = self.module_ref()
        if module is None:
            raise RuntimeError(f"the experts module {self.name} was freed while a compiled graph still uses it")
        return module

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's MLP on the tokens routed to it, in the module's dtype."""
        module, layout = self.module, self.layout
        first = first_projection(module)
        gate_up_bias = getattr(module, f"{first}_bias")[expert] if layout.bias else None
        down_bias = module.down_proj_bias[expert] if layout.bias else None
        hidden = Gate.of(layout, module)(_project(x, getattr(module, first)[expert], gate_up_bias, layout.transposed))
        return _project(hidden, module.down_proj[expert], down_bias, layout.transposed)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        module = self.module
        offload = getattr(module, "dflash_offload", None)
        if offload is not None:  # host blobs behind a device slot pool (dflash_compile.offload)
            offloaded, layer = offload
            return offloaded.run(layer, hidden, top_k_index, top_k_weights, Gate.of(self.layout, module))
        if getattr(module, "packed_format", None):  # MXFP4 / FP8 weights kept packed (dflash_compile.packed)
            return run_packed(hidden, top_k_index, top_k_weights, *packed_weights(module), Gate.of(self.layout, module))
        if self.fused and module.down_proj.dtype in FUSED_DTYPES:  # weights in place
            return run_packed(hidden, top_k_index, top_k_weights, *expert_weights(module), Gate.of(self.layout, module))
        if hidden.is_cuda:  # transformers' grouped GEMM: no host sync, one kernel per projection
            return grouped_mm_experts_forward(module, hidden, top_k_index, top_k_weights)
        return self.reference(hidden, top_k_index, top_k_weights)

    def reference(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Reference routed-experts math: every family's Experts forward, accumulated in fp32."""
        experts = self.module.down_proj.shape[0]
        return expert_sum(hidden, top_k_index, top_k_weights, experts, self.expert_mlp)


class ExpertStore:
    """The routed experts of one compiled root module, one entry per MoE layer, addressed by handle."""

    def __init__(self) -> None:
        self.id = next(_store_ids)
        self._layers: list[ResidentExperts] = []
        self._handles: dict[tuple[int, bool], int] = {}  # (id(experts module), fused) -> handle
        _STORES_BY_ID[self.id] = self

    def __len__(self) -> int:
        return len(self._layers)

    def add_layer(self, module: torch.nn.Module, spec: FamilySpec, name: str, fused: bool = False) -> int:
        """The handle of `module`'s experts run through dflash's fused kernel or not (`ResidentExperts.fused`),
        registering them the first time. Graphs compiled with either choice hold their own handle, so two compiles
        of one model with different choices each keep theirs."""
        key = (id(module), fused)
        handle = self._handles.get(key)
        if handle is None or self._layers[handle].module_ref() is not module:
            _check_layout(module, spec)
            handle = len(self._layers)
            self._layers.append(ResidentExperts(weakref.ref(module), spec.layout, name, fused))
            self._handles[key] = handle
        return handle

    def layer(self, handle: int) -> ResidentExperts:
        return self._layers[handle]

    def dispatch(self, handle: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self._layers[handle].forward(hidden, top_k_index, top_k_weights)


def store_for(root: torch.nn.Module) -> ExpertStore:
    """The store of a root module, created on first use and freed with the module."""
    store = _STORES_BY_ROOT.get(root)
    if store is None:
        store = _STORES_BY_ROOT[root] = ExpertStore()
    return store


def get_store(store_id: int) -> ExpertStore:
    store = _STORES_BY_ID.get(store_id)
    if store is None:
        raise RuntimeError(f"expert store {store_id} no longer exists: its model was freed; compile the model again")
    return store
