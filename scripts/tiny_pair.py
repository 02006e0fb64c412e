"""Reproduce the bundled default model pair: a byte-level BPE tokenizer, a tiny Qwen3-MoE target and its DFlash
drafter, all trained here on the Python standard library's own sources (available offline everywhere).

    python scripts/tiny_pair.py --out dflash_compile/default_pair                  # minutes on one GPU
    python scripts/tiny_pair.py --out /tmp/pair --device cpu                       # hours on a 2-core CPU
    python scripts/tiny_pair.py --out ... --stage prepare|target|drafter|evaluate  # one stage at a time

Files whose path hashes to 0 mod 10 are held out: neither the tokenizer, the target nor the drafter sees them;
the prompts in `heldout_prompts.json` (used by the tests and `dflash-compile generate`) come from them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sysconfig
import time
import zlib
from pathlib import Path

import torch

from dflash_compile.training import cosine_learning_rate

SKIPPED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]


def stdlib_sources() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts) from this interpreter's standard library, split by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_DIRS & set(relative.parts[:-1]):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        (heldout if zlib.crc32(str(relative).encode()) % 10 == 0 else train).append(text)
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0],
                                   mask_token=SPECIAL_TOKENS[1])


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids, each file followed by <|endoftext|>."""
    ids = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids.extend(encoded + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.int64)


def target_config(tokenizer, context: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=context, tie_word_embeddings=True,
        router_aux_loss_coef=0.01, output_router_logits=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0,
    )


def batches(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=generator)
        yield torch.stack([stream[s:s + length] for s in starts.tolist()])


def train_target(tokenizer, stream: torch.Tensor, steps: int, batch: int, length: int, device: str):
    """Next-token training of the tiny target on random windows of the stream (with the router's balance loss)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target_config(tokenizer, length), dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = batches(stream, batch, length, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_learning_rate(step, steps, 3e-3, warmup=100)
        ids = next(data).to(device)
        loss = model(ids, labels=ids, output_router_logits=True).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"target step {step} loss {loss.item():.3f} {time.perf_counter() - start:.0f}s", flush=True)
    return model.eval()


def select_heldout_prompts(texts: list[str], tokenizer, count: int, max_tokens: int = 96,
                           max_lines: int = 8) -> list[str]:
    """Code-completion prompts from held-out files: a function's `def` line after as many of the lines before it
    (at most `max_lines`) as fit in `max_tokens`, so that prompt + 128 new tokens stay in the target's context."""
    prompts = []
    for text in texts:
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*def \w+\(.*\):\s*$", line) and i >= 4:
                start = max(0, i - max_lines)
                while len(tokenizer("\n".join(lines[start: i + 1]) + "\n").input_ids) > max_tokens and start < i:
                    start += 1
                prompts.append("\n".join(lines[start: i + 1]) + "\n")
                break
    return prompts[:count]


def prepare(out: Path, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenizer (saved with the target) and held-out prompts into `out`; returns the training and held-out token
    streams."""
    train, heldout = stdlib_sources()
    tokenizer = train_tokenizer(train, vocab)
    tokenizer.save_pretrained(out / "target")
    (out / "heldout_prompts.json").write_text(json.dumps(select_heldout_prompts(heldout, tokenizer, 24), indent=1))
    stream = token_stream(tokenizer, train)
    print(f"{len(train)} training files, {len(heldout)} held out, {stream.numel()} training tokens")
    return stream, token_stream(tokenizer, heldout)


@torch.no_grad()
def heldout_loss(out: Path, stream: torch.Tensor, device: str, length: int = 256, windows: int = 64) -> float:
    """The target's mean next-token loss (nats) on held-out text: the target is a real language model of code."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(device).eval()
    ids = stream[: length * windows].view(windows, length).to(device)
    return target(ids, labels=ids).loss.item()


def train_pair_drafter(out: Path, stream: torch.Tensor, args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_compile.training import DrafterTraining, train_drafter

    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    pieces = [chunk.tolist() for chunk in stream.split(4096)]
    settings = DrafterTraining(block_size=8, layers=args.drafter_layers, steps=args.drafter_steps,
                               batch_size=args.drafter_batch, sequences=args.sequences,
                               learning_rate=args.drafter_lr, blocks_per_sequence=args.blocks,
                               continuation_length=args.continuation, generation_batch=args.generation_batch)
    train_drafter(target, pieces, args.work / "drafter", settings=settings, mask_token_id=tokenizer.mask_token_id,
                  save_dtype=torch.bfloat16)
    (out / "drafter").mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(args.work / "drafter" / name, out / "drafter" / name)


def evaluate(out: Path, heldout: torch.Tensor, device: str, max_new_tokens: int = 128) -> dict:
    """Mean accepted length on the held-out prompts, whether every output equals the target's generate, and the
    target's held-out loss."""
    from dflash_compile.pair import acceptance_on_prompts, heldout_prompts

    result = acceptance_on_prompts(out, heldout_prompts(out), device, max_new_tokens)
    result["target_heldout_loss_nats"] = heldout_loss(out, heldout, device)
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the pair goes (the package's default_pair)")
    parser.add_argument("--work", type=Path, default=Path(".pair_work"), help="token stream, drafter state")
    parser.add_argument("--stage", choices=["all", "prepare", "target", "drafter", "evaluate"], default="all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--target-steps", type=int, default=3000)
    parser.add_argument("--drafter-steps", type=int, default=5000)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--drafter-batch", type=int, default=128)
    parser.add_argument("--drafter-lr", type=float, default=2e-3)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per training sequence")
    parser.add_argument("--sequences", type=int, default=65536, help="target continuations the drafter learns from")
    parser.add_argument("--continuation", type=int, default=128, help="tokens per target continuation")
    parser.add_argument("--generation-batch", type=int, default=1024, help="prompts continued at once")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    stream_file = args.work / "streams.pt"
    if args.stage in ("all", "prepare"):
        torch.save([s.to(torch.int16) for s in prepare(args.out, args.vocab)], stream_file)
    stream, heldout = (s.to(torch.int64) for s in torch.load(stream_file))
    if args.stage in ("all", "target"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.out / "target")
        target = train_target(tokenizer, stream, args.target_steps, args.batch, args.length, args.device)
        target.to(torch.bfloat16).save_pretrained(args.out / "target")  # bf16 on disk: the bundle stays small
    if args.stage in ("all", "drafter"):
        train_pair_drafter(args.out, stream, args)
    if args.stage in ("all", "evaluate"):
        evaluate(args.out, heldout, args.device)


if __name__ == "__main__":
    main()
