"""Host time of the offload path per MoE layer call, on any machine (no GPU needed):

    python bench/offload_host.py            # Qwen3-shaped routing (128 experts, top-8), tiny experts, 25% resident

The offload path's Python sits on the critical path once per layer on the GPU (between reading a layer's routing
and queuing its copies), so its cost is worth tracking where it can be measured cheaply. A Qwen3-30B-A3B-shaped
router and cache over tiny experts keeps the copies and kernels negligible; the profiler attributes the rest.
Prints microseconds per layer call (cumulative, cProfile on) of `OffloadedExperts.run` and its parts.
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dflash_compile  # noqa: E402
from dflash_compile.offload import plan_offload  # noqa: E402

PARTS = ("run", "_routed_experts", "_fetch", "_prefetch", "_assign", "_copy", "run_packed", "predict_experts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", type=float, default=0.25, help="fraction of all experts the slots hold")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=64,
                                         moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=128, num_experts_per_tok=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plan = plan_offload(model, "cpu")
    slots = max(int(args.resident * plan.experts_per_layer * plan.layers), plan.experts_per_layer)
    fast = dflash_compile.optimize(model, gpu_memory=plan.dense_bytes + plan.reserve_bytes + slots * plan.blob_bytes,
                                   device="cpu")
    ids = torch.randint(0, config.vocab_size, (1, 16))
    fast.generate(ids, max_new_tokens=8)  # compiles
    offloaded = fast.model.dflash_offload
    calls = offloaded.stats.per_layer_calls
    profile = cProfile.Profile()
    profile.enable()
    fast.generate(ids, max_new_tokens=args.new)
    profile.disable()
    calls = offloaded.stats.per_layer_calls - calls
    stats = pstats.Stats(profile).stats
    print(f"{calls} layer calls, {offloaded.slots} slots for {plan.experts_per_layer * plan.layers} experts")
    for part in PARTS:
        for (file, _, name), (_, count, _, cumulative, _) in stats.items():
            if name == part and Path(file).name in ("offload.py", "expert_store.py"):
                print(f"{part:16s} {cumulative / calls * 1e6:7.1f} us per layer call ({count} calls)")


if __name__ == "__main__":
    main()
