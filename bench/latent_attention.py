"""One latent-attention layer's attention over the cache (DeepSeek-V3, GLM-4.7-Flash): transformers' expansion of
every cached latent through kv_b_proj, then grouped-query attention (what the decoder ran before; `dflash::
decode_attention` where it takes the shapes), against `attention.absorbed_attention` in the latent space. Each side
compiled and replayed in a CUDA graph; the layer's real shape with random bf16 weights.

    python bench/latent_attention.py                                   # H200: GLM-4.7-Flash, 1-16 tokens
    python bench/latent_attention.py --model deepseek-v3 --slots 1024 8192 --tokens 1 16
    python bench/latent_attention.py --device cpu --slots 64 --tokens 1    # a smoke run on a CPU (no timing)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import transformers

from dflash_compile.attention import absorbed_attention, grouped_query_attention
from dflash_compile.cache import additive_mask
from dflash_compile.cost_model import reference_config


def attention_layer(model: str, device: str) -> torch.nn.Module:
    """The model's first attention layer, real shape, random bf16 weights."""
    config = reference_config(model, layers=1)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).model.layers[0].self_attn


def step_inputs(layer, tokens: int, slots: int, device: str):
    """A step's queries of `tokens` new tokens and a cache of `slots` latents half filled (the mask shows that half
    plus the new tokens causally)."""
    query = torch.randn(1, layer.num_heads, tokens, layer.qk_head_dim, device=device, dtype=torch.bfloat16)
    rotary_key = torch.randn(1, 1, slots, layer.qk_rope_head_dim, device=device, dtype=torch.bfloat16)
    latent = torch.randn(1, 1, slots, layer.kv_lora_rank, device=device, dtype=torch.bfloat16)
    visible = torch.arange(slots, device=device) <= slots // 2 + torch.arange(tokens, device=device)[:, None]
    return query, rotary_key, latent, additive_mask(visible[None], torch.bfloat16)


def expanded(layer, query, rotary_key, latent, mask):
    key, value = layer.expand_kv(latent, rotary_key)
    return grouped_query_attention(layer, query, key, value, mask, scaling=layer.scaling)[0]


def absorbed(layer, query, rotary_key, latent, mask):
    return absorbed_attention(layer, query, rotary_key, latent, mask, layer.scaling)


def us(call, device: str) -> float:
    if device != "cuda":
        call()
        return float("nan")
    import triton

    return triton.testing.do_bench_cudagraph(call) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-4.7-flash", choices=["glm-4.7-flash", "deepseek-v3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--slots", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(args.model, torch.__version__, torch.cuda.get_device_name() if args.device == "cuda" else args.device)
    print("| tokens | slots | expanded us | absorbed us | speed-up | max difference |")
    print("|---|---|---|---|---|---|")
    sides = {name: torch.compile(side, dynamic=False) for name, side in (("expanded", expanded),
                                                                          ("absorbed", absorbed))}
    layer = attention_layer(args.model, args.device).eval()
    with torch.no_grad():
        for tokens, slots in itertools.product(args.tokens, args.slots):
            inputs = step_inputs(layer, tokens, slots, args.device)
            outs = {name: side(layer, *inputs) for name, side in sides.items()}
            times = {name: us(lambda side=side: side(layer, *inputs), args.device) for name, side in sides.items()}
            difference = (outs["expanded"].float() - outs["absorbed"].float()).abs().max().item()
            print(f"| {tokens} | {slots} | {times['expanded']:.1f} | {times['absorbed']:.1f} | "
                  f"{times['expanded'] / times['absorbed']:.2f}x | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
