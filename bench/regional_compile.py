"""What compiling a MoE model costs by its depth: the whole model as one graph (what the decoder's steps do now: Dynamo
unrolls the layer loop, Inductor compiles every layer's copy) against each decoder layer compiled on its own
(`layer.compile()`: Dynamo traces the first layer and the others reuse its code, their parameters being inputs).

    python bench/regional_compile.py --layers 2 8 24            # tiny Qwen3-MoE layers, CPU

Each row runs in a fresh process with a fresh Inductor cache (cold), then once more on that cache (warm), and prints
the first forward's seconds (compilation included), the graphs Dynamo made and whether the logits equal the eager
model's. Plain transformers modules and torch.compile only, without a cache (`use_cache=False`): a layer that
updates a cache passes its `layer_idx`, an int Dynamo specializes on, and then every layer compiles again until
the recompile limit (8) leaves the rest eager. The dflash passes are not applied either, so this measures what
regional compilation could save, not a path of the library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def child(layers: int, regional: bool, backend: str) -> None:
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        if regional:
            for layer in model.model.layers:
                layer.compile(backend=backend)
            forward = model
        else:
            forward = torch.compile(model, backend=backend)
        start = time.perf_counter()
        logits = forward(ids, use_cache=False).logits
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "graphs": counters["stats"]["unique_graphs"],
                      "same": torch.allclose(logits, expected, atol=1e-4)}))


def run(layers: int, regional: bool, backend: str, cache: str) -> dict:
    command = [sys.executable, __file__, "--child", str(layers), str(int(regional)), backend]
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor"],
                        help="torch.compile backends (eager: Dynamo's trace alone)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        layers, regional, backend = args.child
        child(int(layers), regional == "1", backend)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| backend | layers | compiled | cold s | warm s | graphs | same logits |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        for layers in args.layers:
            for regional in (False, True):
                with tempfile.TemporaryDirectory() as cache:
                    cold, warm = run(layers, regional, backend, cache), run(layers, regional, backend, cache)
                print(f"| {backend} | {layers} | {'each layer' if regional else 'whole model'} | {cold['seconds']:.2f} "
                      f"| {warm['seconds']:.2f} | {cold['graphs']} | {cold['same'] and warm['same']} |", flush=True)


if __name__ == "__main__":
    main()
