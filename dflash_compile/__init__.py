"""dflash-compile: compiler-style speed-ups for Hugging Face Mixture-of-Experts models.

    compiled = torch.compile(model, backend="dflash")     # every MoE layer's experts -> dflash::moe_dispatch
    report = dflash_compile.explain(model, input_ids)      # pass matches, graph breaks, the graphs
    fast = dflash_compile.optimize(model, drafter=path)    # DFlash speculative decoding, same tokens as generate
    dflash_compile.train_drafter(model, texts, "drafter/", tokenizer=tokenizer)   # a drafter for any target
    dflash_compile.quantize(model, "out/", "mxfp4")       # MXFP4 (gpt-oss) / FP8 block checkpoint, public layout
    dflash_compile.quantize_checkpoint("bf16/", "out/", "fp8_block")   # the same from disk, layer by layer
    model = dflash_compile.load_packed("out/")             # experts stay packed; fused kernels run them on CUDA
    fast = dflash_compile.optimize(model, gpu_memory="20GiB")   # experts in host memory, a slot pool on the GPU
"""

from . import ops, seam
from .api import OptimizedModel, from_pretrained, optimize
from .backend import dflash_backend
from .checkpoint import load_packed, quantize, quantize_checkpoint
from .drafter import DFlashDrafter, DrafterConfig, DrafterPairingError
from .expert_store import ExpertStore
from .explain import ExplainReport, explain
from .families import FAMILIES, FamilySpec, UnsupportedFamilyError, supported_families
from .offload import offload_experts
from .training import DrafterTraining, train_drafter

seam.install()

__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterPairingError",
    "DrafterTraining",
    "OptimizedModel",
    "optimize",
    "quantize",
    "quantize_checkpoint",
    "FAMILIES",
    "ExpertStore",
    "ExplainReport",
    "FamilySpec",
    "UnsupportedFamilyError",
    "dflash_backend",
    "explain",
    "from_pretrained",
    "load_packed",
    "offload_experts",
    "ops",
    "supported_families",
    "train_drafter",
]
__version__ = "0.1.0"
