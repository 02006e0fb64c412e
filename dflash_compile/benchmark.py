"""Side-by-side generation benchmark (what `dflash-compile bench` runs): transformers' generate, dflash without a
drafter, the drafter at its fixed block, the adaptive width, and the same drafter with shuffled weights (a drafter
that does not pay); every output checked against generate; tokens/s as medians; a markdown table and two plots.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from .api import optimize
from .drafter import load_drafter, save_drafter


@dataclass
class Row:
    name: str
    tokens_per_second: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verify step (all prompts)
    widths: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # mean wall time per verify step, per prompt

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_second)


def timed(fn, repeats: int, device="cpu"):
    """(last result, median seconds) of `repeats` calls after one warm-up call (compilation, caches); CUDA work is
    synchronised around every call."""
    return timed_together([fn], repeats, device)[0]


def timed_together(fns, repeats: int, device="cpu") -> list[tuple]:
    """`timed` for functions to compare: one warm-up call each, then the repeats round-robin (A B, B A, A B, ...),
    so a machine that speeds up or slows down during the run (a shared 2-core CPU: plain decoding of the bundled
    pair read 214-334 tok/s within minutes) moves both sides' medians alike instead of the ratio."""
    cuda = str(device).startswith("cuda")
    results = [fn() for fn in fns]
    times = [[] for _ in fns]
    for repeat in range(repeats):
        order = range(len(fns)) if repeat % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            results[i] = fns[i]()
            if cuda:
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
    return [(result, statistics.median(seconds)) for result, seconds in zip(results, times)]


def shuffled_drafter(model, drafter_dir: Path, directory: Path) -> Path:
    """The drafter's config with each weight's rows shuffled: the same cost, drafts the target rejects."""
    drafter, _ = load_drafter(drafter_dir, model)
    generator = torch.Generator().manual_seed(0)
    weights = {k: v[torch.randperm(v.shape[0], generator=generator)] if v.ndim > 1 else v
               for k, v in drafter.state_dict().items()}
    return save_drafter(directory, json.loads((Path(drafter_dir) / "config.json").read_text()), weights)


def compare(model, prompt_ids: list[torch.Tensor], drafter_dir: Path, new_tokens: int, repeats: int,
            compile: bool) -> list[Row]:
    device = model.device
    with tempfile.TemporaryDirectory() as tmp:
        setups = {
            "transformers generate": None,
            "dflash, no drafter": {"drafter": None},
            "dflash, drafter, fixed block": {"drafter": drafter_dir, "adaptive": False},
            "dflash, drafter, adaptive width": {"drafter": drafter_dir},
            "dflash, shuffled drafter, fixed block": {"drafter": shuffled_drafter(model, drafter_dir,
                                                                                  Path(tmp) / "shuffled"),
                                                      "adaptive": False},
        }
        setups["dflash, shuffled drafter, adaptive"] = {**setups["dflash, shuffled drafter, fixed block"],
                                                        "adaptive": True}
        rows = {name: Row(name) for name in setups}
        for ids in prompt_ids:
            fasts = {name: optimize(model, compile=compile, **options) for name, options in setups.items()
                     if options is not None}
            runs = [partial(fasts[name].generate, ids, max_new_tokens=new_tokens) if name in fasts
                    else partial(model.generate, ids, max_new_tokens=new_tokens, do_sample=False) for name in rows]
            timings = dict(zip(rows, timed_together(runs, repeats, device)))  # alternating: drift moves all alike
            expected = timings["transformers generate"][0]
            for name, (out, seconds) in timings.items():
                rows[name].tokens_per_second.append((out.shape[1] - ids.shape[1]) / seconds)
                if name not in fasts:
                    continue
                if not torch.equal(out, expected):
                    raise AssertionError(f"{name}: the output differs from transformers' generate")
                stats, row = fasts[name].last_stats, rows[name]
                row.accepted += [a for step in stats.accepted for a in step if a is not None]
                row.widths += stats.widths
                row.step_seconds.append(seconds / max(stats.steps, 1))
    return list(rows.values())


def markdown(rows: list[Row], title: str) -> str:
    base = next(r for r in rows if r.name == "dflash, no drafter").median
    lines = [f"### {title}", "", "| setup | tok/s (median) | vs dflash without drafter | mean accepted length "
             "| steps with drafts |", "|---|---|---|---|---|"]
    for row in rows:
        tau = (statistics.mean(row.accepted) + 1) if row.accepted else 1.0
        drafted = f"{sum(w > 1 for w in row.widths)}/{len(row.widths)}" if row.widths else "-"
        lines.append(f"| {row.name} | {row.median:.1f} | {row.median / base:.2f}x | {tau:.2f} | {drafted} |")
    return "\n".join(lines) + "\n"


def plots(rows: list[Row], block_size: int, predicted_step_seconds: dict[int, float], out: Path) -> list[Path]:
    """acceptance.png: accepted drafts per verify step at the fixed block; step_time.png: measured mean step time
    against the cost model's prediction, per verify width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = next(r for r in rows if r.name == "dflash, drafter, fixed block")
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist(fixed.accepted, bins=range(block_size + 1), align="left", rwidth=0.8)
    axis.set(xlabel="accepted drafts per verify step", ylabel="steps",
             title=f"acceptance at block {block_size} (mean accepted length "
                   f"{statistics.mean(fixed.accepted) + 1:.2f})")
    paths = [out / "acceptance.png"]
    figure.tight_layout()
    figure.savefig(paths[0], dpi=120)
    measured = {1: statistics.median(next(r for r in rows if r.name == "dflash, no drafter").step_seconds),
                block_size: statistics.median(fixed.step_seconds)}
    figure, axis = plt.subplots(figsize=(6, 3.5))
    widths = sorted(measured)
    axis.plot(widths, [measured[w] * 1e3 for w in widths], "o-", label="measured (mean per step)")
    axis.plot(widths, [predicted_step_seconds[w] * 1e3 for w in widths], "s--", label="cost model")
    axis.set(xlabel="tokens verified per step", ylabel="ms per step", title="step time: measured vs predicted")
    axis.legend()
    paths.append(out / "step_time.png")
    figure.tight_layout()
    figure.savefig(paths[1], dpi=120)
    plt.close("all")
    return paths
