import re

import pytest
import torch

from dflash_compile.cli import main


def test_explain_on_the_built_in_default(capsys):
    assert main(["explain", "--family", "olmoe", "--tokens", "5", "--repeats", "1", "--graphs"]) == 0
    out = capsys.readouterr().out
    assert "graphs: 1, graph breaks: 0" in out
    assert "pass matches: expert_dispatch=2" in out
    assert out.count("torch.ops.dflash.moe_dispatch.default(") == 2
    assert "routed experts: 2 layers resident on cpu, float32" in out
    difference = float(out.split("max |compiled - eager| logits: ")[1].split()[0])
    assert difference <= 1e-4


def test_explain_on_a_checkpoint_directory(tiny_dirs, capsys):
    assert main(["explain", "--model", str(tiny_dirs("qwen3_moe")), "--tokens", "4", "--repeats", "1"]) == 0
    assert "pass matches: expert_dispatch=2" in capsys.readouterr().out


def test_argument_errors(capsys):
    with pytest.raises(SystemExit, match="--tokens must be at least 1"):
        main(["explain", "--tokens", "0"])
    with pytest.raises(SystemExit):
        main(["explain", "--family", "llama"])
    assert "invalid choice: 'llama'" in capsys.readouterr().err


# Below, runs whose subject is not compiling pass --no-compile: compiling the pair takes ~30-50 s of the CI's 2 cores.


def test_generate_on_the_bundled_pair(capsys):
    assert main(["generate", "--max-new-tokens", "24", "--repeats", "1", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):\n")
    assert "24 new tokens, block 8" in out and "same tokens: True" in out
    tau = float(out.split("mean accepted length ")[1].split()[0])
    speedup = float(out.split("tok/s: ")[1].split("x")[0])
    assert 1.0 <= tau <= 8.0 and speedup > 0


def test_generate_samples(capsys):
    """--sample draws from the target's distribution: with top-k 1 that is the greedy text, whatever the draws; with
    top-k 40 a seed gives the same text on every run (the width fixed at the block: an adaptive one would follow
    measured step times and change how many random numbers a step draws) and two seeds two texts; the line says the
    sides' tokens are draws (no token check); sampling settings without --sample are refused."""
    def text(*options):
        assert main(["generate", "--max-new-tokens", "24", "--repeats", "1", "--no-compile", *options]) == 0
        out = capsys.readouterr().out
        assert out.startswith("def fibonacci(n):\n")
        assert ("; sampled from the same distribution" in out) == ("--sample" in options)
        if "--seed" in options:  # every step verified the whole block
            assert re.search(r"verify steps \(8 tokens x \d+\)", out)
        return out.split("\n--- ")[0]

    assert text("--sample", "--temperature", "1.5", "--top-k", "1") == text()
    sampled = ("--sample", "--temperature", "1.5", "--top-k", "40")
    assert text(*sampled, "--seed", "1") == text(*sampled, "--seed", "1") != text(*sampled, "--seed", "2")
    with pytest.raises(SystemExit, match=r"^--temperature, --top-p, --seed apply when sampling: add --sample \(without "
                                         r"it generation is greedy\)$"):
        main(["generate", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"])


def test_generate_says_when_it_compiles(capsys, monkeypatch):
    """--compile asks `optimize` to compile and says so on stderr, with the first generate's time (the compile
    itself runs eagerly here: compiling the pair on this CPU takes ~50 s of the CI's budget). Without the flag a CPU
    compiles too where Inductor finds a C++ compiler; without one it runs eagerly and says why."""
    from torch._inductor import cpp_builder, exc

    import dflash_compile

    asked = []
    real_optimize = dflash_compile.optimize

    def optimize(model, **options):
        asked.append(options["compile"])
        return real_optimize(model, **{**options, "compile": False})

    monkeypatch.setattr(dflash_compile, "optimize", optimize)
    assert main(["generate", "--max-new-tokens", "4", "--repeats", "1", "--compile"]) == 0
    err = capsys.readouterr().err
    assert asked == [True] and "compiling the step in the first generate" in err
    # the eager generate of the tiny pair can take under 0.05 s: the time is checked for its form, not its size
    assert re.search(r"first generate, compiling included: \d+\.\d s\n", err)
    assert main(["generate", "--max-new-tokens", "4", "--repeats", "1"]) == 0  # a CPU's default, with g++: compile
    assert asked == [True, True] and "compiling the step" in capsys.readouterr().err

    def no_compiler():
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    assert main(["generate", "--max-new-tokens", "4", "--repeats", "1"]) == 0
    err = capsys.readouterr().err
    assert asked == [True, True, False] and "compiling the step" not in err
    assert ("no C++ compiler for Inductor's CPU code (install g++ or set CXX to compile the step): the step runs "
            "eagerly\n") in err
    assert main(["generate", "--max-new-tokens", "4", "--repeats", "1", "--no-compile"]) == 0
    assert asked == [True, True, False, False] and "no C++ compiler" not in capsys.readouterr().err


def test_generate_without_a_drafter(capsys):
    """--model alone: one token a step on the optimized target, the same tokens as its own generate."""
    from dflash_compile.pair import pair_paths

    target, _ = pair_paths()
    assert main(["generate", "--model", str(target), "--max-new-tokens", "6", "--repeats", "1", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "block 1, 5 verify steps (1 token x 5), mean accepted length 1.00" in out
    assert "same tokens: True" in out


def test_generate_dtype_defaults():
    from dflash_compile.cli import _dtype

    assert _dtype(None, "cuda:1", bundled=False) is torch.bfloat16
    assert _dtype(None, "cpu", bundled=False) is _dtype(None, "cuda", bundled=True) is torch.float32
    assert _dtype("float32", "cuda", bundled=False) is torch.float32


def test_generate_streams_the_tokens(capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "12", "--repeats", "1", "--stream",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import os\n") and "12 new tokens" in out


def test_generate_argument_errors(tiny_dirs):
    with pytest.raises(SystemExit, match="--drafter needs --model, the target it drafts for"):
        main(["generate", "--drafter", "somewhere"])
    with pytest.raises(SystemExit, match="dflash-compile generate: no/such/dir is neither a checkpoint directory nor "
                                         "a Hugging Face Hub repo id"):
        main(["generate", "--model", "no/such/dir"])
    tokenless = tiny_dirs("nemotron_h")  # weights and config, no tokenizer
    with pytest.raises(SystemExit, match=rf"dflash-compile generate: {tokenless} has no tokenizer transformers can "
                                         r"load \(.*\); the prompts are text: save the model's tokenizer beside"):
        main(["generate", "--model", str(tokenless)])
    with pytest.raises(SystemExit, match=r"dflash-compile generate: prefill_chunk must be at least 1 token \(or "
                                         r"None: optimize's choice\), got 0"):
        main(["generate", "--prefill-chunk", "0"])
    with pytest.raises(SystemExit, match=r"dflash-compile generate: offload options \(offload_manager='host'\) "
                                         "apply only to experts offloaded to host memory, and without gpu_memory"):
        main(["generate", "--offload-manager", "host"])


def test_train_drafter_writes_a_loadable_checkpoint(tmp_path, capsys):
    import json

    import dflash_compile
    from dflash_compile.pair import DEFAULT_PAIR, load_target

    data = tmp_path / "texts.jsonl"
    data.write_text("\n".join(json.dumps(text) for text in [
        {"text": "def add(a, b):\n    return a + b\n" * 8}, "class A:\n    pass\n" * 10]))
    out = tmp_path / "drafter"
    assert main(["train-drafter", "--target", str(DEFAULT_PAIR / "target"), "--data", str(data), "--out", str(out),
                 "--steps", "3", "--batch-size", "2", "--sequences", "4", "--prompt-length", "16",
                 "--continuation-length", "8", "--block-size", "4", "--layers", "1", "--device", "cpu"]) == 0
    assert f"drafter written to {out}" in capsys.readouterr().out
    assert len((out / "training" / "log.jsonl").read_text().splitlines()) == 3
    model, _ = load_target(DEFAULT_PAIR / "target")
    fast = dflash_compile.optimize(model, drafter=out, compile=False)
    assert fast.decoder.block_size == 4


def test_train_drafter_rejects_bad_data(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: expected a JSON string or an object with a \"text\" string"):
        main(["train-drafter", "--target", "x", "--data", str(data), "--out", str(tmp_path / "d")])


def test_quantize_writes_a_packed_checkpoint_that_generates(tmp_path, capsys):
    """The bundled Qwen3-MoE target as FP8: 8 bits per expert weight, loadable by `generate --model`, and
    `explain --model` runs it as loaded: experts packed, the FP8 projections' dequantize fused."""
    from dflash_compile.pair import DEFAULT_PAIR

    out = tmp_path / "fp8"
    with pytest.raises(SystemExit):  # refused as the command line is read, before the checkpoint is
        main(["quantize", "--model", "no-such-model", "--out", str(out), "--format", "fp8_block", "--max-shard-size",
              "2 gigs"])
    assert ("argument --max-shard-size: max_shard_size must be a positive number of bytes or a size such as '5GB' "
            "or '500MB', got '2 gigs'") in capsys.readouterr().err and not out.exists()
    assert main(["quantize", "--model", str(DEFAULT_PAIR / "target"), "--out", str(out), "--format", "fp8_block",
                 "--dtype", "float32", "--max-shard-size", "2MB"]) == 0
    files = len(list(out.glob("model-*.safetensors")))
    assert files > 1 and re.search(rf"fp8_block checkpoint written to .* \({files} weight files\): routed experts "
                                   r"[0-9.]+ MiB, 8.00 bits per weight", capsys.readouterr().out)
    assert main(["generate", "--model", str(out), "--drafter", str(DEFAULT_PAIR / "drafter"), "--max-new-tokens",
                 "16", "--repeats", "1", "--no-compile"]) == 0
    assert "same tokens: True" in capsys.readouterr().out
    assert main(["explain", "--model", str(out), "--tokens", "4", "--repeats", "1"]) == 0
    explained = capsys.readouterr().out
    assert "routed experts: 4 layers resident on cpu, fp8_block" in explained
    assert "pass matches: expert_dispatch=4, dequant_fusion=16," in explained


def test_bench_writes_a_report_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--count", "1", "--max-new-tokens", "12", "--repeats", "1", "--no-compile", "--out",
                 str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report.count("\n| dflash") == 5 and "| transformers generate |" in report
    for plot in ("acceptance.png", "step_time.png"):
        data = (out / plot).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    with pytest.raises(SystemExit, match="give both --model and --drafter"):
        main(["bench", "--drafter", "x"])


def test_build_kernels_command(capsys, monkeypatch):
    from dflash_compile.kernels import cuda_rows

    monkeypatch.setenv("DFLASH_CUDA_ROWS", "0")
    cuda_rows.load.cache_clear()
    assert main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "C++ CPU kernels loaded", "CUDA row kernels unused: off (DFLASH_CUDA_ROWS=0)"]
    cuda_rows.load.cache_clear()


def test_timed_together_alternates_the_sides():
    """One warm-up call each, then the repeats round-robin in alternating order, so drift of the machine's speed
    during a run moves both medians alike; each side's last result comes back with its median."""
    from dflash_compile.benchmark import timed_together

    calls = []
    sides = [lambda: calls.append("a") or len(calls), lambda: calls.append("b") or len(calls)]
    (a, a_seconds), (b, b_seconds) = timed_together(sides, repeats=3)
    assert "".join(calls) == "ab" + "ab" + "ba" + "ab"
    assert (a, b) == (7, 8) and a_seconds >= 0 and b_seconds >= 0
