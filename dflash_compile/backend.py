"""The `dflash` torch.compile backend: run the pass pipeline on the Dynamo graph, then lower it.

    torch.compile(model, backend="dflash")                                      # passes + Inductor
    torch.compile(model, backend="dflash", options={"lowering": "aot_eager"})   # passes + AOT eager (debugging)
    torch.compile(model, backend="dflash", options={"passes": []})              # no passes
    torch.compile(model, backend="dflash", options={"fused_experts": False})    # transformers' experts kernels

`dflash_backend` is a plain function found through the `torch_dynamo_backends` entry point (pyproject.toml). Only a
source checkout on sys.path without `pip install` lacks that entry point: there the import registers the name
(`_register_without_entry_point`); with the entry point present it must not, or torch's lookup fails as a duplicate.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

from .families import spec_for_model, traced_unadapted, warn_dense
from .graph_text import graph_text
from .passes import PassContext, check_pass_names, run_pipeline

log = logging.getLogger(__name__)

LOWERINGS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class BackendOptions:
    passes: tuple[str, ...] | None = None  # None: the whole pipeline
    lowering: str = "inductor"
    inductor: dict = field(default_factory=dict)  # Inductor config patches
    fused_experts: bool = True  # resident bf16 / fp32 experts run dflash's fused kernel (else transformers' path)

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        unknown = set(options) - {"passes", "lowering", "inductor", "fused_experts"}
        if unknown:
            raise ValueError(f"unknown dflash backend option(s) {sorted(unknown)}; valid: passes, lowering, inductor, "
                             "fused_experts")
        passes = options.get("passes")
        if passes is not None:
            passes = tuple(passes)
            check_pass_names(passes)
        lowering = options.get("lowering", "inductor")
        if lowering not in LOWERINGS:
            raise ValueError(f"unknown lowering {lowering!r}; choose one of {LOWERINGS}")
        return cls(passes, lowering, dict(options.get("inductor", {})), bool(options.get("fused_experts", True)))


@dataclass
class GraphReport:
    """What the pipeline did to one Dynamo graph."""

    matches: dict[str, int]
    before: str
    after: str


def _lower(gm: GraphModule, example_inputs, options: BackendOptions, mode: str | None) -> Callable:
    if options.lowering == "eager":
        return gm.forward
    if options.lowering == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    # graph_partition: CUDA graphs (mode="reduce-overhead") capture everything but the ops tagged cudagraph_unsafe
    # (offloaded experts), instead of giving up on the whole graph.
    patches = {"graph_partition": True, **(list_mode_options(mode) if mode else {}), **options.inductor}
    return compile_fx(gm, example_inputs, config_patches=patches)


def _dense_model(gm: GraphModule, ctx: PassContext) -> torch.nn.Module | None:
    """The traced model when it is a transformers model without routed experts. Raises UnsupportedFamilyError for
    a MoE model of a family the registry does not know, ValueError for one traced before its family's `adapt`."""
    root = ctx.traced_root(gm.graph)
    if root is None or not hasattr(root, "config"):
        return None
    spec = spec_for_model(root)
    reasons = traced_unadapted(root)
    if reasons:
        raise ValueError(f"{spec.name}'s experts are routed experts dflash-compile dispatches only after the family's "
                         f"adapt ({'; '.join(reasons)}): call dflash_compile.families.adapt_model(model) before "
                         "torch.compile(model, backend='dflash') (optimize does), with the same sums")
    return root if spec is None else None


def compile_graph(
    gm: GraphModule,
    example_inputs,
    options: dict | None = None,
    mode: str | None = None,
    on_graph: Callable[[GraphReport], None] | None = None,
) -> Callable:
    """Passes then lowering for one Dynamo graph; `on_graph` receives the report (used by `explain`)."""
    parsed = BackendOptions.parse(options)
    ctx = PassContext.from_dynamo(example_inputs, fused_experts=parsed.fused_experts)
    dense = _dense_model(gm, ctx)  # before any pass: an unsupported family must fail with nothing changed
    before = graph_text(gm) if on_graph else ""
    matches = run_pipeline(gm, ctx, parsed.passes)
    log.info("dflash passes matched %s", matches)
    if dense and matches.get("expert_dispatch") == 0:
        warn_dense(type(dense).__name__)
    if on_graph:
        on_graph(GraphReport(matches, before, graph_text(gm)))
    _make_lasting_buffers(example_inputs)
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)):
        return _lower(gm, example_inputs, parsed, mode)
    # A model straight from from_pretrained has parameters that require grad, and grad mode is on outside
    # torch.no_grad(): lowered as is, AOTAutograd would trace a backward through the inference-only dflash ops.
    warnings.warn("dflash compiles inference graphs: outputs of this compiled model do not track gradients (run it "
                  "under torch.no_grad() or torch.inference_mode() to silence this warning)", stacklevel=2)
    with torch.no_grad():
        return _without_grad(_lower(gm, example_inputs, parsed, mode))


def _without_grad(compiled: Callable) -> Callable:
    """`compiled`, called under torch.no_grad(), in the same calling convention (Inductor's may be boxed)."""

    def run(*args):
        with torch.no_grad():
            return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _make_lasting_buffers(example_inputs) -> None:
    """The fused kernels' buffers that live for the process, made now for the graph's CUDA devices
    (`make_arrival_counts`): its first run may be a CUDA-graph warm-up, whose allocations must not outlive it. The
    CUDA row kernels are built (or found unused) now as well, and a bad DFLASH_CUDA_ROWS raises before any run."""
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda}
    if devices:
        from .kernels import cuda_rows
        from .kernels.arrivals import make_arrival_counts

        for device in devices:
            make_arrival_counts(device)
        cuda_rows.load()


def dflash_backend(gm: GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """The `backend="dflash"` entry point of torch.compile."""
    return compile_graph(gm, example_inputs, options=options, mode=mode)


def _register_without_entry_point() -> None:
    """backend="dflash" for a checkout that was put on sys.path instead of installed (no package metadata)."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import register_backend

    if "dflash" not in entry_points(group="torch_dynamo_backends").names:
        register_backend(dflash_backend, name="dflash")


_register_without_entry_point()


@functools.cache
def dflash_backend_with(**options) -> Callable:
    """`dflash_backend` with these options, one object per set of options: Dynamo reuses a compiled graph only for
    an equal backend, so compilations with the same options (e.g. several decoders over one model) share graphs."""
    return functools.partial(dflash_backend, options=options)
