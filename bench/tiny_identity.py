"""Whether a tiny model's tokens through the decoder differ from `model.generate` by a bug or by a near-tie (CUDA).

    python3 bench/tiny_identity.py --family gpt_oss --dtype bfloat16
    python3 bench/tiny_identity.py --family solar_open --offload

Greedy tokens of `model.generate` against `optimize(model, random drafter).generate`, with attention through
`dflash::decode_attention`'s kernel and in torch's math, and with `--offload` the model offloaded with two slots
above one layer of experts and with a slot for every expert (host-managed). Where the decoder's tokens leave the
reference's, the reference's logits at that position tell which: the gap between its token's logit and the
decoder's token's logit (near 0: a near-tie the dtype's rounding can flip, not a wrong result).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from step_overhead import in_torch_attention

import dflash_compile
from dflash_compile.offload import plan_offload
from dflash_compile.testing import load_tiny_model, random_drafter_weights, save_drafter, tiny_drafter_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt_oss")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--offload", action="store_true", help="also offloaded: 2 slots above a layer, every expert")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_tiny_model(args.family).to(args.device, dtype)
    print("| prompt seed | run | same tokens | first difference | reference logit gap there |\n"
          "|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_drafter_config(model.config, block_size=4)
        drafter = save_drafter(tmp, config, random_drafter_weights(config))
        runs = {"decode kernel": dflash_compile.optimize(model, drafter).generate,
                "torch's math": in_torch_attention(dflash_compile.optimize(model, drafter).generate)}
        if args.offload:
            plan = plan_offload(model, args.device)
            for name, slots in (("offloaded, 2 slots above a layer", 2),
                                ("offloaded, every expert in a slot", plan.experts_per_layer * plan.layers)):
                budget = plan.minimum_budget + slots * plan.blob_bytes
                runs[name] = dflash_compile.optimize(load_tiny_model(args.family, dtype), drafter, gpu_memory=budget,
                                                     device=args.device, offload_manager="host").generate
        for seed in range(args.seeds):
            ids = torch.randint(3, 127, (1, 9), generator=torch.Generator().manual_seed(seed)).to(args.device)
            with torch.no_grad():
                reference = model.generate(ids, do_sample=False, max_new_tokens=args.new, output_logits=True,
                                           return_dict_in_generate=True)
            for name, generate in runs.items():
                tokens = generate(ids, max_new_tokens=args.new)
                print(f"| {seed} | {name} | {', '.join(_difference(reference, tokens, ids.shape[1]))} |")


def _difference(reference, tokens: torch.Tensor, prompt: int) -> list[str]:
    """Same tokens, the first new token that differs, and the reference's logit of its token minus ours there."""
    length = min(reference.sequences.shape[1], tokens.shape[1])
    differ = (reference.sequences[0, :length] != tokens[0, :length]).nonzero()
    if len(differ) == 0:
        return ["True", "-", "-"]
    at = differ[0].item()
    logits = reference.logits[at - prompt][0].float()
    gap = logits[reference.sequences[0, at]] - logits[tokens[0, at]]
    return ["False", str(at - prompt), f"{gap.item():.4f}"]


if __name__ == "__main__":
    main()
