"""The cost model against the numbers FORMATS.md and the H200 floors quote, and its command line."""

import csv
import json
import re

import pytest
import sympy

from dflash_compile.cli import main
from dflash_compile.cost_model import (
    CSV_COLUMNS, HARDWARE, HELD_OUT_STEPS, MEASURED_STEPS, REFERENCE_CONFIGS, B, C, Hardware, ModelSizes, StepCost,
    calibrate, fit_step_overheads, reference_config)
from dflash_compile.testing import in_installed_transformers, save_release


@pytest.fixture(scope="module")
def gpt_oss_20b():
    return ModelSizes.of(reference_config("gpt-oss-20b"))


def test_expected_distinct_experts(gpt_oss_20b):
    cost = StepCost(gpt_oss_20b, HARDWARE["h200"])
    assert sympy.simplify(cost.distinct_experts.subs(B, 1)) == 4
    assert round(float(cost.distinct_experts.subs(B, 16)), 1) == 28.2  # "about 28 of 32 experts"
    assert float(cost.distinct_experts.subs(B, 10_000)) == pytest.approx(32)


@pytest.mark.skipif(not in_installed_transformers("longcat_flash"), reason="LongCat-Flash needs transformers 5.25")
def test_zero_compute_picks_read_no_expert():
    """LongCat-Flash-Chat's 12 picks a token choose among 512 routed and 256 zero-compute experts: a token reads 8
    experts on average (12 x 512 / 768), and a step over many tokens at most the 512."""
    sizes = ModelSizes.of(reference_config("longcat-flash-chat", 1))
    assert (sizes.experts, sizes.zero_compute_experts, sizes.top_k) == (512, 256, 12)
    cost = StepCost(sizes, HARDWARE["h200"])
    assert cost.distinct_experts.subs(B, 1) == 8
    assert float(cost.distinct_experts.subs(B, 100_000)) == pytest.approx(512)
    assert cost.flops.subs({B: 1, C: 0}) == 2 * (sizes.dense_params + 8 * sizes.expert_params)


def test_one_gpt_oss_layer_matches_the_documented_floors(gpt_oss_20b):
    """FORMATS.md: 13.2 MB per MXFP4 expert; M=1 reads 4 experts (>= 11 us), 16 tokens >= 78 us at 4.8 TB/s."""
    datasheet = Hardware("h200-datasheet", hbm=4.8e12, pcie=55e9, flops=989e12, step_overhead=0.0)
    cost = StepCost(gpt_oss_20b, datasheet, expert_bits=4.25)
    assert cost.expert_bytes / 1e6 == pytest.approx(13.2, abs=0.05)
    for tokens, floor_us in ((1, 11), (16, 78)):
        layer_us = float(cost.distinct_experts.subs(B, tokens)) * cost.expert_bytes / datasheet.hbm * 1e6
        assert layer_us == pytest.approx(floor_us, rel=0.02)


def test_bf16_step_floors_match_the_measured_benchmark_floors(gpt_oss_20b):
    """bench/spec_decode.py's floors on the H200 (docs/benchmarks.md): 1.83 / 7.10 / 9.03 ms at blocks 1 / 8 / 16
    with a 512-token context, counted from the built model with measured routing."""
    cost = StepCost(gpt_oss_20b, HARDWARE["h200"].roofline())
    for block, measured_floor_ms in ((1, 1.83), (8, 7.10), (16, 9.03)):
        assert cost.evaluate(block, 512)["t_step_us"] / 1e3 == pytest.approx(measured_floor_ms, rel=0.1)


def test_the_h200_profile_predicts_measured_steps_within_25_percent():
    """Decode and verify 8 / 16 steps measured on the H200: the default profile's step and layer overheads and
    efficiency are the least-squares fit to gpt-oss-20b's (the whole model and a 4-layer cut), Qwen3-30B-A3B's and
    OLMoE-1B-7B's steps (re-fitted here), and predict each of them and the held-out DeepSeek-V3 step within 25%."""
    fitted = fit_step_overheads(HARDWARE["h200"])
    for field in ("step_overhead", "layer_overhead", "efficiency"):
        assert getattr(fitted, field) == pytest.approx(getattr(HARDWARE["h200"], field), rel=1e-3), field
    for (model, layers, tokens, context), seconds in {**MEASURED_STEPS, **HELD_OUT_STEPS}.items():
        sizes = ModelSizes.of(reference_config(model, layers))
        predicted = StepCost(sizes, HARDWARE["h200"]).evaluate(tokens, context)["t_step_us"] * 1e-6
        assert predicted == pytest.approx(seconds, rel=0.25), (model, layers, tokens)
    with pytest.raises(ValueError, match="two layer counts"):
        fit_step_overheads(HARDWARE["h200"], {key: MEASURED_STEPS[key] for key in list(MEASURED_STEPS)[:3]})


def test_offload_fetch_and_tokens_per_second(gpt_oss_20b):
    cost = StepCost(gpt_oss_20b, HARDWARE["h200"], expert_bits=4.25)
    row = cost.evaluate(8, 1024, hit_rate=0.75, tau=4.0)
    assert row["fetch_bytes"] == pytest.approx(24 * row["distinct_experts_per_layer"] * 0.25 * cost.expert_bytes)
    assert row["t_fetch_us"] == pytest.approx(row["fetch_bytes"] / 55e9 * 1e6)
    assert row["tokens_per_s"] == pytest.approx(4.0 / (row["t_step_us"] * 1e-6))
    assert cost.evaluate(8, 1024, hit_rate=1.0)["fetch_bytes"] == 0


def test_sliding_layers_read_at_most_their_window(gpt_oss_20b):
    cost = StepCost(gpt_oss_20b, HARDWARE["h200"])
    growth = cost.evaluate(1, 4096)["bytes"] - cost.evaluate(1, 2048)["bytes"]
    assert growth == pytest.approx(2048 * gpt_oss_20b.kv_elements_per_token * 2)  # full layers only


def test_roofline_command_writes_the_documented_csv(tmp_path, capsys):
    out = tmp_path / "roofline.csv"
    assert main(["roofline", "--model", "qwen3-30b-a3b", "--device", "h100", "--csv", str(out), "--blocks", "1",
                 "8", "--acceptance", "0.5"]) == 0
    assert "best block:" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert tuple(rows[0]) == CSV_COLUMNS and [r["block"] for r in rows] == ["1", "8"]
    assert float(rows[1]["tau"]) == pytest.approx((1 - 0.5**8) / 0.5)


def test_roofline_on_the_built_in_default_and_a_calibrated_profile(tmp_path, capsys):
    profile = tmp_path / "cpu.json"
    assert main(["calibrate", "--out", str(profile), "--device", "cpu"]) == 0
    measured = json.loads(profile.read_text())
    assert measured["hbm"] > 1e9 and measured["flops"] > 1e9
    assert main(["roofline", "--hardware", str(profile)]) == 0
    assert "on cpu (bf16 experts)" in capsys.readouterr().out
    assert isinstance(calibrate("cpu", size_mib=8, repeats=1), Hardware)


def test_roofline_reads_a_deepseek_v4_releases_mxfp4_experts_beside_fp8_linears(tmp_path, capsys):
    directory = save_release("deepseek_v4", tmp_path / "release", moe_intermediate_size=128)
    assert main(["roofline", "--model", str(directory), "--device", "h200", "--blocks", "1"]) == 0
    assert "on h200 (mxfp4 experts)" in capsys.readouterr().out


def test_roofline_argument_errors(capsys):
    with pytest.raises(SystemExit):
        main(["roofline", "--device", "a100"])
    assert "invalid choice: 'a100'" in capsys.readouterr().err


def test_an_image_text_to_text_reference_shape_sizes_its_text_decoder():
    """Qwen3-VL-30B-A3B's text decoder has Qwen3-30B-A3B's shape: cut to 4 layers under its multimodal config, the
    same experts, layers and cache; the vision tower is no part of a decode step."""
    multimodal, text = (ModelSizes.of(reference_config(name, 4)) for name in ("qwen3-vl-30b-a3b", "qwen3-30b-a3b"))
    for field in ("dense_params", "expert_params", "experts", "top_k", "moe_layers", "layers", "kv_elements_per_token"):
        assert getattr(multimodal, field) == getattr(text, field), field


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_every_reference_shape_sizes_its_first_layers(name):
    """Every reference shape builds (on the meta device) and sizes its first 4 layers: experts, their top-k and the
    parameters of one, as `roofline` and `bench/spec_decode.py --model` read them; one that needs a newer
    transformers says so, and too few layers to reach the experts (DeepSeek-V3's first 3 are dense) say that."""
    try:
        config = reference_config(name, 4)
    except ValueError as error:
        assert re.search(r"needs (a newer )?transformers", str(error))  # the config class, or the family's code
        pytest.skip(str(error))
    sizes = ModelSizes.of(config)
    assert sizes.experts > sizes.top_k >= 1 and sizes.expert_params > 0 and 1 <= sizes.moe_layers <= 4
    if name == "deepseek-v3":
        with pytest.raises(ValueError, match="deepseek_v3 with 2 layers has no routed experts in them"):
            ModelSizes.of(reference_config(name, 2))


def test_attention_width_sums_each_layers_own_heads():
    """Step 3.7's sliding layers have fewer heads than its full ones (2 and 4 of 16 here): the attention FLOPs count
    each layer's own, 2 x 16 + 2 x 16 + 4 x 16."""
    from dflash_compile.testing import tiny_multimodal_config

    assert ModelSizes.of(tiny_multimodal_config("step3p7")).attention_width == 128


def test_routed_attention_experts_are_read_per_expert_picked():
    """JetMoE's attention experts (a query and an output projection each, its top-k picked per token) are read as
    its MLP experts are, per expert picked: counted with them, not with the weights every step reads."""
    import torch
    import transformers

    from dflash_compile.testing import tiny_config

    config = tiny_config("jetmoe")
    with torch.device("meta"):
        layer = transformers.AutoModelForCausalLM.from_config(config).model.layers[0]
    mlp, attention = layer.mlp, layer.self_attention.experts
    expert = sum(linear.weight[0].numel() for linear in (mlp.input_linear, mlp.output_linear,
                                                          attention.input_linear, attention.output_linear))
    sizes = ModelSizes.of(config)
    assert sizes.expert_params == expert and sizes.experts == config.num_local_experts
    per_step = sizes.dense_params + sizes.expert_params * sizes.experts * sizes.moe_layers
    total = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert per_step + config.vocab_size * config.hidden_size == total  # every weight counted once (embeddings apart)
