"""The C++ CPU kernels of csrc/: compiled once per machine and torch version on first use, then loaded, which
registers them for the CPU dispatch key of their `dflash::` ops.

    dflash-compile build-kernels          # the set-up step: compile now (otherwise the first CPU MoE call does)

They are compiled with `torch.utils.cpp_extension.load` against the installed torch (cached in
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions; -march=native, as the build is this machine's), not
at `pip install` time: pip's isolated build would
have to install its own torch, which on a CPU machine can mean downloading a CUDA build. Without a C++ compiler (or
with DFLASH_CPU_KERNELS=0) nothing is registered and the ops run their pure-PyTorch reference; `status()` says why.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

from . import build_extension


SOURCES = [Path(__file__).resolve().parents[2] / "csrc" / "moe_cpu.cpp"]
_failure: str | None = None


@functools.cache
def load() -> bool:
    """Compile (first time) and load the CPU kernels; False, with a warning saying why, when they cannot be."""
    global _failure
    if os.environ.get("DFLASH_CPU_KERNELS", "1") == "0":
        _failure = "disabled by DFLASH_CPU_KERNELS=0"
        return False
    missing = [str(path) for path in SOURCES if not path.exists()]
    if missing:
        _failure = f"sources not found ({', '.join(missing)}): install from a source checkout"
    else:
        from .. import ops  # noqa: F401  (the ops these kernels implement must be defined first)

        _, _failure = build_extension(name="dflash_cpu_kernels", sources=[str(path) for path in SOURCES],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                      is_python_module=False, verbose=False)
        if _failure is None:
            return True
    warnings.warn(f"dflash C++ CPU kernels unavailable ({_failure}); CPU MoE layers run the PyTorch reference",
                  stacklevel=2)
    return False


def status() -> str:
    """One line for reports: whether the C++ CPU kernels are in use."""
    return "C++ CPU kernels loaded" if load() else f"C++ CPU kernels unavailable: {_failure}"
