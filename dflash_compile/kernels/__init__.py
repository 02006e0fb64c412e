"""Triton kernels for the dflash ops. Every kernel has an fp32 compute path (a constexpr) so that the CPU tests can
run it under TRITON_INTERPRET=1, whose bf16 arithmetic is wrong. The ops fall back to the pure-PyTorch reference in
`dflash_compile.expert_store` where no kernel is registered."""

import torch


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

    try:
        return cpp_extension.load(**options), None
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
        message = str(error).strip()
        return None, f"build failed: {message.splitlines()[-1] if message else repr(error)}"
