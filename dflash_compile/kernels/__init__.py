"""Triton kernels for the dflash ops. Every kernel has an fp32 compute path (a constexpr) so that the CPU tests can
run it under TRITON_INTERPRET=1, whose bf16 arithmetic is wrong. The ops fall back to the pure-PyTorch reference in
`dflash_compile.expert_store` where no kernel is registered."""
