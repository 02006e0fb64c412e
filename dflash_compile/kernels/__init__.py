"""Triton kernels for the dflash ops. Every kernel has an fp32 compute path (a constexpr) so that the CPU tests can
run it under TRITON_INTERPRET=1, whose bf16 arithmetic is wrong. The ops fall back to the pure-PyTorch reference in
`dflash_compile.expert_store` where no kernel is registered."""

import contextlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def sm_count(device: torch.device) -> int | None:
    """The CUDA device's SM count, which the launches here size their grids by; None elsewhere (the interpreter,
    where there are no SMs to fill)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def build_extension(**options) -> tuple[object, str | None]:
    """`torch.utils.cpp_extension.load(**options)` (compiled once per machine, then loaded from its cache): (its
    result, None), or (None, "build failed: <the error's last line>") without a compiler or ninja, with a broken one
    (CXX naming a program whose `--version` fails: a SubprocessError), or on a build error."""
    import subprocess

    from torch.utils import cpp_extension

    name = options["name"]
    directory = cpp_extension._get_build_directory(name, verbose=False)
    if not any(Path(directory).glob(f"{name}*.so")):  # a silent minute otherwise (nvcc on the CUDA row kernels)
        log.warning("dflash-compile: compiling %s for this machine, once (a minute or two; `dflash-compile "
                    "build-kernels` does it ahead of time)", name)
    try:
        with _no_stale_build_lock(directory):
            return cpp_extension.load(**options), None
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
        message = str(error).strip()
        return None, f"build failed: {message.splitlines()[-1] if message else repr(error)}"


@contextlib.contextmanager
def _no_stale_build_lock(directory: str):
    """Holds an exclusive flock on `<directory>/dflash.lock` while torch builds or loads the extension there. Torch's
    own `lock` file in that directory outlives a build killed midway (a timeout's SIGTERM, SIGKILL), and every later
    load of the extension, cached or not, then waits on it forever. The flock dies with its process, so once it is
    held no live build of ours is running there and a `lock` left behind is stale: removed. (Imported here: where
    there is no fcntl the build fails as `build_extension` reports it, not the package's import.)"""
    import fcntl

    with open(os.path.join(directory, "dflash.lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes or the process dies
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, "lock"))
        yield
