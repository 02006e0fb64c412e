"""Triton kernels for the dflash ops. Every kernel has an fp32 compute path (a constexpr) so that the CPU tests can
run it under TRITON_INTERPRET=1, whose bf16 arithmetic is wrong. The ops fall back to the pure-PyTorch reference in
`dflash_compile.expert_store` where no kernel is registered."""

import torch


def sm_count(device: torch.device) -> int | None:
    """The CUDA device's SM count, which the launches here size their grids by; None elsewhere (the interpreter,
    where there are no SMs to fill)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
