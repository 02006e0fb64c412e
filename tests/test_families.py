import pickle
import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from torch._dynamo.exc import BackendCompilerFailed

import dflash_compile
from dflash_compile import families
from dflash_compile.expert_store import _STORES_BY_ROOT
from dflash_compile.families import (
    FAMILIES, UnsupportedFamilyError, adapt_model, experts_modules, spec_for_config, spec_for_experts_class,
    spec_for_model, traced_unadapted)
from dflash_compile.testing import OracleDrafter, in_installed_transformers, tiny_config, tiny_multimodal_config
from tests.conftest import token_ids


def test_registry_covers_the_seventy_three_families():
    assert dflash_compile.supported_families() == sorted(
        ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss", "glm4_moe", "glm4_moe_lite",
         "deepseek_v2", "deepseek_v3", "olmoe", "ernie4_5_moe", "phimoe", "dots1", "flex_olmo", "solar_open",
         "exaone_moe", "qwen3_vl_moe", "glm4v_moe", "granitemoe", "granitemoeshared", "cohere2_moe",
         "minimax_m2", "hunyuan_v1_moe", "hy_v3", "laguna", "mimo_v2_flash", "afmoe", "gemma4_text", "mellum",
         "kolibri1", "beam", "flint", "granitemoe_swa", "minicpm5_moe", "axk1", "lara_mini", "mistral4", "aria",
         "kimi_linear", "lfm2_moe", "llama4_text", "granitemoehybrid", "ernie4_5_vl_moe", "step3p7", "bailing_hybrid",
         "nemotron_h", "jamba", "dbrx", "longcat_flash", "deepseek_v32", "glm_moe_dsa", "axk2",
         "mistral_large4", "dots3_note", "deepseek_ocr2", "jetmoe", "qwen3_omni_moe", "ergo", "hy_v4",
         "hy_v4_vl", "minimax", "muse_spark", "zaya", "kolibri1_1", "minimax_m3_vl", "inkling",
         "unlimited_ocr", "inkling2", "deepseek_v4", "inkling2_loop", "glm5_next", "qwen4_exp"]
    )


@pytest.mark.parametrize(
    "family, moe_layers, attention",
    [
        ("mixtral", [0, 1], ["full_attention"] * 2),
        ("qwen2_moe", [0, 1], ["full_attention"] * 2),
        ("qwen3_moe", [1, 2], ["full_attention"] * 3),  # mlp_only_layers=[0]
        ("qwen3_5_moe", [0, 1], ["linear_attention", "full_attention"]),
        ("qwen3_next", [0, 1], ["linear_attention", "full_attention"]),
        ("gpt_oss", [0, 1], ["sliding_attention", "full_attention"]),
        ("glm4_moe", [1, 2], ["full_attention"] * 3),  # first_k_dense_replace=1
        ("deepseek_v2", [1, 2], ["full_attention"] * 3),
        ("deepseek_v3", [1, 2], ["full_attention"] * 3),
        ("glm4_moe_lite", [1, 2], ["full_attention"] * 3),  # mlp_layer_types=["dense", "sparse", "sparse"]
        ("olmoe", [0, 1], ["full_attention"] * 2),
        ("ernie4_5_moe", [1, 2], ["full_attention"] * 3),  # moe_layer_start_index=1
        ("phimoe", [0, 1], ["full_attention"] * 2),
        ("dots1", [1, 2], ["full_attention"] * 3),  # first_k_dense_replace=1
        ("flex_olmo", [0, 1], ["full_attention"] * 2),
        ("granitemoe", [0, 1], ["full_attention"] * 2),
        ("minimax_m2", [0, 1], ["full_attention"] * 2),
        ("cohere2_moe", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("granitemoeshared", [0, 1], ["full_attention"] * 2),
        ("solar_open", [0, 1], ["full_attention"] * 2),
        ("exaone_moe", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("hunyuan_v1_moe", [0, 1], ["full_attention"] * 2),
        ("hy_v3", [1, 2], ["full_attention"] * 3),  # mlp_layer_types
        ("laguna", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("mimo_v2_flash", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("afmoe", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # num_dense_layers=1
        ("gemma4_text", [0, 1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # enable_moe_block
        ("mellum", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("kolibri1", [0, 1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),
        ("kolibri1_1", [1, 2, 3], ["sliding_attention", "indexed_attention"] * 2),  # mlp_only_layers=[0]
        ("beam", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("flint", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_only_layers=[0]
        ("granitemoe_swa", [0, 1, 2], ["full_attention", "sliding_attention", "sliding_attention"]),
        ("minicpm5_moe", [1, 2], ["full_attention"] * 3),  # mlp_layer_types
        ("axk1", [1, 2], ["full_attention"] * 3),  # mlp_layer_types
        ("lara_mini", [0, 1, 2], ["linear_attention", "sliding_attention", "full_attention"]),
        ("mistral4", [1, 2], ["full_attention"] * 3),  # first_k_dense_replace=1
        ("aria", [0, 1], ["full_attention"] * 2),
        ("kimi_linear", [1, 2], ["linear_attention", "linear_attention", "full_attention"]),  # mlp_layer_types
        ("bailing_hybrid", [1, 2], ["linear_attention", "linear_attention", "full_attention"]),  # as kimi_linear
        ("nemotron_h", [1, 3], ["linear_attention", "mlp", "full_attention", "mlp"]),  # one mixer a layer
        ("lfm2_moe", [1, 2], ["conv", "conv", "full_attention"]),  # num_dense_layers=1
        ("llama4_text", [1, 3], ["chunked_attention"] * 3 + ["full_attention"]),  # interleave_moe_layer_step=2
        ("granitemoehybrid", [0, 1, 2], ["linear_attention", "linear_attention", "full_attention"]),
        ("dbrx", [0, 1], ["full_attention"] * 2),
        ("jetmoe", [0, 1], ["full_attention"] * 2),
        ("minimax", [0, 1, 2], ["linear_attention", "full_attention", "linear_attention"]),
        ("minimax_m3_vl", [1, 2], ["indexed_attention"] * 3),  # one mask for all layers, read by the sparse ones
        ("zaya", [0, 1, 2], ["full_attention", "sliding_attention", "full_attention"]),  # CCA layers
        ("inkling", [1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),  # mlp_layer_types
        ("inkling2", [0, 1, 2], ["sliding_attention", "sliding_attention", "full_attention"]),
        ("ergo", [1, 2], ["sliding_attention", "full_attention", "sliding_attention"]),  # a dense first layer
        ("longcat_flash", [0, 1], ["full_attention"] * 4),  # two attention sublayers a decoder layer
        ("deepseek_v32", [1, 2], ["indexed_attention"] * 3),  # DSA; first_k_dense_replace=1
        ("glm_moe_dsa", [1, 2], ["indexed_attention"] * 3),
        ("hy_v4", [1, 2], ["indexed_attention"] * 3),  # mlp_layer_types
        ("axk2", [1, 2], ["indexed_attention"] * 3),
    ],
)
def test_spec_of_each_tiny_model(tiny, family, moe_layers, attention):
    model = tiny(family)
    spec = spec_for_config(model.config)
    assert spec is FAMILIES[family]
    assert spec.moe_layers(model.config) == moe_layers
    assert spec.attention_kinds(model.config) == attention
    # the decoder layer holding each experts module, found by class (DBRX's decoder names them blocks)
    layers = list(model.transformer.blocks if family == "dbrx" else model.model.layers)
    experts = {i: type(module) for name, module in experts_modules(model).items()
               for i, layer in enumerate(layers) if module in layer.modules()}
    assert sorted(experts) == moe_layers
    assert all(spec_for_experts_class(cls) is spec for cls in experts.values())


def test_the_supported_models_table_names_each_family_and_its_experts_class():
    """docs/supported_models.md is what the registry says: one row per family, its model types and experts class."""
    page = (Path(__file__).parents[1] / "docs" / "supported_models.md").read_text()
    rows = {}
    for line in page.split("\n## ")[0].splitlines():  # the first table, before the page's sections
        if line.startswith("| `") and not line.startswith("| `model_type`"):
            model_types, experts = line.split(" | ")[:2]
            rows[tuple(re.findall(r"`(\w+)`", model_types))] = experts.strip("`")
    assert rows == {spec.model_types: spec.experts_class for spec in FAMILIES.values()}


def test_qwen3_sparse_step_glm_declared_layers_and_mixtral_window():
    qwen = transformers.Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert FAMILIES["qwen3_moe"].moe_layers(qwen) == [1]
    glm = transformers.Glm4MoeLiteConfig(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    assert FAMILIES["glm4_moe_lite"].moe_layers(glm) == [1, 3]
    mixtral = transformers.MixtralConfig(num_hidden_layers=2, sliding_window=16)
    assert FAMILIES["mixtral"].attention_kinds(mixtral) == ["sliding_attention"] * 2


def _tiny_privacy_filter():
    """OpenAI's privacy filter (openai_privacy_filter): a token classifier, not causal generation, so not in the
    registry; its routed experts are of transformers' kind."""
    config = transformers.OpenAIPrivacyFilterConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        pad_token_id=0, eos_token_id=2)
    return transformers.AutoModelForTokenClassification.from_config(config).eval()


def test_unsupported_moe_family_is_a_clear_error_before_any_state():
    model = _tiny_privacy_filter()
    # Dynamo wraps whatever a backend raises in BackendCompilerFailed; ours is the inner exception.
    message = ("model_type 'openai_privacy_filter' is a Mixture-of-Experts model that dflash-compile does not "
               "support yet")
    with pytest.raises(BackendCompilerFailed, match=message) as err:
        with torch.no_grad():
            torch.compile(model, backend="dflash", options={"lowering": "eager"})(token_ids(1, 4))
    assert isinstance(err.value.inner_exception, UnsupportedFamilyError)
    assert ", ".join(dflash_compile.supported_families()) in str(err.value)
    assert model not in _STORES_BY_ROOT  # nothing registered before the error


def test_doges_single_neuron_experts_are_refused_by_name():
    """Doge's CDMoE (experts one neuron each, a router mixing the batch's tokens: docs/supported_models.md says why
    it is not supported) has no `experts` module: its config's expert count names it a Mixture-of-Experts family."""
    config = transformers.DogeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=16,
                                     num_experts_per_tok=4, is_moe=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedFamilyError, match=r"^model_type 'doge' is a Mixture-of-Experts model that "
                                                     r"dflash-compile does not support yet"):
        dflash_compile.optimize(model)
    assert model not in _STORES_BY_ROOT


def test_a_family_on_too_old_a_transformers_is_refused_before_any_state(monkeypatch):
    """Jamba's verify blocks need transformers 5.25's scan, which reads the cached state (5.24's ignores it):
    `optimize` on 5.24 names the version and the fix before it changes the model."""
    config = transformers.JambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, num_experts=4, attn_layer_period=2,
                                      attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    monkeypatch.setattr(families.transformers, "__version__", "5.24.0")  # the version the registry reads
    with pytest.raises(UnsupportedFamilyError, match=r"^model_type 'jamba' needs transformers >= 5.25 \(installed: "
                                                     r"5.24.0\): pip install -U transformers$"):
        dflash_compile.optimize(model)
    assert model not in _STORES_BY_ROOT and not hasattr(model, "dflash_offload")


def test_unsupported_experts_class_is_recognised_without_a_config():
    experts = _tiny_privacy_filter().model.layers[0].mlp.experts
    with pytest.raises(UnsupportedFamilyError, match=r"OpenAIPrivacyFilterExperts .* does not support yet"):
        spec_for_experts_class(type(experts))


def test_dense_model_compiles_with_zero_matches_and_a_warning():
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = token_ids(1, 5)
    with pytest.warns(UserWarning, match="has no routed experts: dflash-compile compiled it with 0 expert_dispatch"):
        report = dflash_compile.explain(model, ids)
    assert report.matches == {"expert_dispatch": 0, "dequant_fusion": 0, "projection_fusion": 0, "small_top_k": 0,
                              "split_k_linear": 3}  # 5 rows: k and v (32 -> 16) and the MLP's down (64 -> 32)
    with torch.no_grad(), pytest.warns(UserWarning, match="no routed experts"):
        out = torch.compile(model, backend="dflash", options={"lowering": "aot_eager"})(ids).logits
        torch.testing.assert_close(out, model(ids).logits)


def test_llama4_blocks_call_routed_experts_with_transformers_sums(tiny):
    """Llama 4's MoE blocks run every expert on every token, the router's sigmoid scores on their inputs (zero for
    the experts not chosen); adapted (by `experts_modules` on the way), each chosen (token, expert) pair is one row
    through its expert: the same logits in fp32, and adapting again changes nothing."""
    model = tiny("llama4_text")
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids).logits
        assert list(experts_modules(model)) == [f"model.layers.{i}.feed_forward.experts" for i in (1, 3)]
        torch.testing.assert_close(adapt_model(model)(ids).logits, expected, atol=1e-5, rtol=1e-5)


def _refused_until_adapted(model, ids, reasons: str) -> None:
    """`torch.compile(model, backend="dflash")` before the family's adapt is refused, naming what transformers'
    modules do (`reasons`) and the fix."""
    family = spec_for_config(model.config).name
    message = (f"{family}'s experts are routed experts dflash-compile dispatches only after the family's adapt "
               f"({reasons}): call dflash_compile.families.adapt_model(model)")
    with pytest.raises(BackendCompilerFailed, match=re.escape(message)):
        torch.compile(model, backend="dflash")(ids)


def test_llama4_traced_before_adapting_is_refused(tiny):
    _refused_until_adapted(tiny("llama4_text"), token_ids(),
                           "Llama 4's MoE blocks run every expert on every token; Llama 4's NoPE layers scale queries "
                           "by the cache's one length")


def test_dbrx_experts_moved_into_transformers_layout_give_its_logits(tiny, tmp_path):
    """DBRX's experts loop over flattened 2-D weights (`mlp.w1` / `v1` / `w2`, [E * I, H]); adapted, they are
    routed experts with `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] holding the same values (nothing of the
    old weights left), the model's fp32 logits as transformers' own, adapting again changes nothing, and the adapted
    model saves whole. Traced before adapting, it is refused with the fix."""
    model = tiny("dbrx")
    ids = token_ids()
    mlp = model.transformer.blocks[1].ffn.experts.mlp
    w1, v1, w2 = (weight.detach().clone().view(8, 32, 64) for weight in (mlp.w1, mlp.v1, mlp.w2))
    _refused_until_adapted(model, ids, "DBRX's experts loop over flattened 2-D weights")
    with torch.no_grad():
        expected = model(ids).logits
        assert list(experts_modules(model)) == [f"transformer.blocks.{i}.ffn.experts" for i in (0, 1)]
        experts = model.transformer.blocks[1].ffn.experts
        assert torch.equal(experts.gate_up_proj, torch.cat([w1, v1], dim=1))
        assert torch.equal(experts.down_proj, w2.transpose(1, 2))
        assert not any(name.endswith(("w1", "v1", "w2")) for name, _ in model.named_parameters())
        torch.testing.assert_close(adapt_model(model)(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.save(model, tmp_path / "model.pt")
        reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not traced_unadapted(reloaded) and torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.skipif(not in_installed_transformers("longcat_flash"),
                    reason="transformers 5.24 keeps the zero-compute experts in an undecorated experts module")
def test_longcat_zero_compute_picks_read_no_expert_the_token_did_not_pick(tiny, tmp_path):
    """LongCat-Flash's router picks among 8 routed experts and 4 zero-compute ones (indices 8-11) that return their
    input. Adapted, its MoE blocks call the routed experts with each zero-compute pick moved to the token's
    lowest-numbered routed pick at weight 0 (expert 0 where it has none), and `route` (offload's prefetch) gives what
    the experts get: the logits stay transformers' own, bit for bit; adapting again changes nothing and the adapted
    model saves whole. Traced before adapting, it is refused with the fix. A drafter pairs with its 2 decoder layers
    (`num_layers`; `num_hidden_layers` counts its 4 attention sublayers)."""
    model = tiny("longcat_flash")
    ids, hidden = token_ids(), torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    block = model.model.layers[1].mlp
    _refused_until_adapted(model, ids, "LongCat-Flash's MoE blocks send zero-compute picks to experts the token did "
                                       "not pick")
    with torch.no_grad():
        expected = model(ids).logits
        _, weights, picks = block.router(hidden)
        zero = picks >= 8
        assert (zero.any(1) & ~zero.all(1)).any() and zero.all(1).any()  # rows of both kinds, of zero-compute alone
        adapt_model(model)
        assert list(experts_modules(model)) == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
        routed_weights, index = block.route(hidden)
        assert torch.equal(index[~zero], picks[~zero]) and torch.equal(routed_weights[~zero], weights[~zero])
        assert not routed_weights[zero].any()
        lowest = [min((int(p) for p in row if p < 8), default=0) for row in picks]
        assert all((index[row][zero[row]] == lowest[row]).all() for row in range(64))
        assert torch.equal(adapt_model(model)(ids).logits, expected)
        torch.save(model, tmp_path / "model.pt")
        reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not traced_unadapted(reloaded) and torch.equal(reloaded(ids).logits, expected)
    assert model.config.num_hidden_layers == 4 and families.decoder_layers(model.config) == 2
    assert len(model(ids, output_hidden_states=True).hidden_states) == 2 + 1


@pytest.mark.parametrize("compile", [False, True])
def test_llama4_past_its_chunks_and_query_temperature_matches_generate(tiny, compile):
    """Llama 4's chunked layers keep a ring of chunk - 1 + block slots, each query seeing its own chunk's keys, and
    its NoPE layers scale queries from floor_scale - 1 slots on, by each row's own slot (transformers takes the
    cache's one length, which rows accepted in part do not share; the adapted layers read the rows' lengths): one
    row and left-padded rows of 4, 7 and 9 prompt tokens, 9 + 40 tokens over several chunks (of 8, counted from each
    row's first real token, as transformers' masks count them) with the scale rising every 16 slots, through blocks
    of 4 accepted in part, give transformers' tokens. Compiled, the padded rows only (a batch of one would compile
    the step a second time)."""
    if not compile:
        model = tiny("llama4_text", attention_chunk_size=8, floor_scale=16, attn_scale=8.0)
        ids, mask = token_ids(batch=1), None
        with torch.no_grad():
            expected = model.generate(ids, do_sample=False, max_new_tokens=40)
        fast = dflash_compile.optimize(model, OracleDrafter(expected, mask, 4, corruption=0.3, vocab_size=128),
                                       adaptive=False, compile=compile)
        assert torch.equal(fast.generate(ids, max_new_tokens=40), expected)
        assert 1.5 < fast.last_stats.tau < 4
    rows, mask = token_ids(batch=3), torch.ones(3, 9, dtype=torch.long)
    mask[0, :5], mask[1, :2] = 0, 0
    rows = rows * mask
    batched = tiny("llama4_text", attention_chunk_size=8, floor_scale=16, attn_scale=8.0)
    with torch.no_grad():
        expected = batched.generate(rows, attention_mask=mask, do_sample=False, max_new_tokens=40)
    fast = dflash_compile.optimize(batched, OracleDrafter(expected, mask, 4, corruption=0.3, vocab_size=128),
                                   adaptive=False, compile=compile)
    assert torch.equal(fast.generate(rows, attention_mask=mask, max_new_tokens=40), expected)
    assert fast.decoder.target_cache.rows.sizes == {layer: 8 - 1 + 4 for layer in (0, 1, 2)}  # the chunked layers
    unpickled = pickle.loads(pickle.dumps(batched))  # hooks of module-level functions: the adapted model pickles
    with torch.no_grad():  # and its own generate, the hooks scaling as transformers' layer did, is transformers'
        assert torch.equal(unpickled.generate(rows, attention_mask=mask, do_sample=False, max_new_tokens=40), expected)


def test_ernie_vl_image_experts_are_left_to_the_model():
    """ERNIE-4.5-VL's MoE layers hold text and image experts of one class; text prompts call the text ones only, so
    those alone are routed experts to dflash-compile (dispatched, offloaded)."""
    config = tiny_multimodal_config("ernie4_5_vl_moe")
    model = transformers.AutoModelForImageTextToText.from_config(config)
    experts = [name for name, module in model.named_modules() if type(module).__name__ == "Ernie4_5_VLMoeMoeExperts"]
    assert len(experts) == 4
    assert list(experts_modules(model)) == [f"model.language_model.layers.{i}.mlp.text_moe.experts" for i in (1, 2)]


def test_dots3_vision_experts_are_left_to_the_model(tmp_path):
    """dots.llm3's image-audio release: its vision tower's MoE blocks hold experts of the text decoder's class; text
    prompts never run them, so only the decoder's are routed experts to dflash-compile, and its text prompts give
    `generate`'s tokens."""
    from transformers.models.dots3_note import configuration_dots3_note as dots3

    tower = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2)
    vision = dots3.Dots3NoteVisionConfig(num_hidden_layers=2, moe_intermediate_size=16, num_experts_per_tok=2,
                                         pyramid_num_routed=[-1, 4], adapter_in_dim=32, adapter_out_dim=64, **tower)
    audio = dots3.Dots3NoteAudioConfig(num_hidden_layers=1, downsample_hidden_size=16, adapter_input_size=32,
                                       adapter_out_dim=64, **tower)
    config = transformers.Dots3NoteConfig(text_config=tiny_config("dots3_note").to_dict(),
                                          vision_config=vision.to_dict(), audio_config=audio.to_dict())
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    assert "model.vision_tower.blocks.1.mlp.experts" in dict(model.named_modules())
    assert list(experts_modules(model)) == [f"model.language_model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    ids, mask = token_ids(), torch.ones(2, 9, dtype=torch.long)
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    fast = dflash_compile.optimize(model, adaptive=False, compile=False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=12), expected)


CLAMPS_LING_3 = Version(transformers.__version__) >= Version("5.25")  # transformers 5.24's Ling 3 has no clamps


def test_an_adapted_step3p7_model_pickles(tmp_path):
    """transformers 5.24 leaves Step 3.7's experts undecorated and `adapt` swaps in a subclass made at run time: the
    model still saves whole (torch.save, loaded in a new process), pickles and deep-copies, with the same logits (on
    5.25, whose class is decorated, the same holds trivially)."""
    import copy
    import subprocess
    import sys

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_multimodal_config("step3p7")).eval()
    adapt_model(model)
    assert not traced_unadapted(model)
    ids = token_ids(batch=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert not traced_unadapted(clone)
            assert torch.equal(clone(input_ids=ids).logits, logits)
    torch.save(model, tmp_path / "model.pt")
    load = (f"import torch; model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); "
            f"print(type(model).__name__)")
    assert subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                          check=True).stdout.strip() == "Step3p7ForConditionalGeneration"


@pytest.mark.parametrize("family, swapped", [("kolibri1_1", "Kolibri1_1Indexer"),
                                             ("minimax_m3_vl", "MiniMaxM3VLIndexer"), ("inkling", "InklingAttention")])
def test_modules_an_adapter_subclassed_at_run_time_pickle(tiny, family, swapped):
    """Kolibri 1.1's and MiniMax-M3's indexers and Inkling's attention layers get subclasses made at run time
    (`subclassing.subclass_once`): the adapted model still pickles, its modules of those classes again, with the same
    logits."""
    model = adapt_model(tiny(family))
    ids = token_ids(batch=1)
    clone = pickle.loads(pickle.dumps(model))
    classes = {type(module) for module in clone.modules() if swapped in type(module).__name__}
    assert classes == {type(module) for module in model.modules() if swapped in type(module).__name__}
    assert all(cls.__name__ != swapped for cls in classes)  # the run-time subclasses, not transformers' own
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", ["step3p7", "bailing_hybrid"])
def test_experts_clamp_in_the_layers_their_config_names(tiny, family):
    """Step 3.7's experts (and from transformers 5.25 Ling 3's) clamp SiLU(gate) and up at `swiglu_limits[layer]`
    (0: no clamp): layer 1's at 0.5, layer 2's plain SiLU; transformers 5.24's undecorated Step 3.7 experts class is
    decorated by the family's `adapt`. The tokens of such a layer are checked by each family's identity tests."""
    from dflash_compile.expert_store import Gate

    if family == "step3p7":
        model = transformers.AutoModelForImageTextToText.from_config(tiny_multimodal_config("step3p7"))
        assert bool(traced_unadapted(model)) == (not CLAMPS_LING_3)  # 5.24: undecorated until adapted
    else:
        model = tiny(family)
    gates = [Gate.of(FAMILIES[family].layout, module) for module in experts_modules(model).values()]
    clamped = family == "step3p7" or CLAMPS_LING_3
    assert gates == [Gate(False, "clamped_silu" if clamped else "silu", limit=0.5 if clamped else 7.0),
                     Gate(False, "silu")]
    assert not traced_unadapted(model)


def test_jetmoe_experts_grouped_without_host_lists_give_its_logits(tiny, tmp_path):
    """JetMoE's MLP and attention experts split their rows by a host list of group sizes. Adapted, each MoE block
    calls a routed-experts module holding the same two tensors (`gate_up_proj`, `down_proj`; nothing else of the old
    modules left) and the attention experts group rows by sorting: the fp32 logits are transformers' own bit for bit,
    random output biases included, Dynamo captures the model in one graph, adapting again changes nothing, and the
    adapted model saves whole. Traced before adapting, it is refused with the fix."""
    model = tiny("jetmoe")
    ids = token_ids()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ in ("JetMoeMoE", "JetMoeMoA"):
                module.bias.normal_(generator=torch.Generator().manual_seed(0))
    block = model.model.layers[1].mlp
    gate_up, down = block.input_linear.weight, block.output_linear.weight
    # Dynamo breaks the graph first inside the attention's experts: the backend gets the attention layer's graph
    _refused_until_adapted(model, ids, "JetMoE's attention experts split their rows by a host list of group sizes")
    with torch.no_grad():
        expected = model(ids).logits
        assert list(experts_modules(model)) == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
        assert block.experts.gate_up_proj is gate_up and block.experts.down_proj is down
        assert not hasattr(block, "input_linear") and not hasattr(block, "output_linear")
        assert torch.equal(adapt_model(model)(ids).logits, expected)
        assert dflash_compile.explain(model, ids).graph_break_count == 0
        torch.save(model, tmp_path / "model.pt")
        reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not traced_unadapted(reloaded) and torch.equal(reloaded(ids).logits, expected)


def test_jetmoe_attention_experts_without_grouped_mm_give_the_grouped_products():
    """Where torch's grouped_mm takes no such weights on CUDA (fp16, fp32), JetMoE's attention experts multiply every
    row by every expert and keep its own (transformers' loop would read the group sizes on the host inside a CUDA
    graph): the products of the grouped GEMM."""
    from transformers.integrations.moe import _grouped_linear

    generator = torch.Generator().manual_seed(0)
    experts = torch.sort(torch.randint(0, 4, (12,), generator=generator)).values
    offsets = torch.cumsum(torch.bincount(experts, minlength=4), dim=0, dtype=torch.int32)
    inputs, weight = torch.randn(12, 16, generator=generator), torch.randn(4, 8, 16, generator=generator)
    torch.testing.assert_close(families._every_expert_linear(inputs, weight, experts),
                               _grouped_linear(inputs, weight, offsets), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not in_installed_transformers("ergo"), reason="transformers 5.24 has no Ergo")
def test_ergo_route_norms_moved_into_the_block_give_its_logits(tiny, tmp_path):
    """Ergo's experts module derives from its projections' class and norms each route by its expert after them.
    Adapted, the MoE block holds the norm and its experts module is the projections' class (the same weights): the
    fp32 logits are transformers' own bit for bit, adapting again changes nothing, and the adapted model saves
    whole. Traced before adapting, it is refused with the fix."""
    model = tiny("ergo")
    ids = token_ids()
    block = model.model.layers[1].mlp
    up, down, norm = block.experts.up_proj, block.experts.down_proj, block.experts.post_expert_norm.weight
    _refused_until_adapted(model, ids, "Ergo's experts norm each route's output by its expert inside the experts "
                           "module")
    with torch.no_grad():
        expected = model(ids).logits
        assert list(experts_modules(model)) == [f"model.layers.{i}.mlp.experts" for i in (1, 2)]
        assert type(block.experts).__name__ == "ErgoExpertProjections" and block.post_expert_norm.weight is norm
        assert block.experts.up_proj is up and block.experts.down_proj is down
        assert torch.equal(adapt_model(model)(ids).logits, expected)
        torch.save(model, tmp_path / "model.pt")
        reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not traced_unadapted(reloaded) and torch.equal(reloaded(ids).logits, expected)


def test_muse_spark_route_norm_moved_into_the_block_gives_its_logits(tmp_path):
    """Muse Spark's experts norm each route's output (one norm for every expert) before the routing weights sum
    them. Adapted, the MoE block holds the norm and the experts module an identity in its place (the same expert
    weights): the fp32 logits are transformers' own, adapting again changes nothing, and the adapted model saves
    whole. Traced before adapting, it is refused with the fix."""
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_multimodal_config("muse_spark")).eval()
    ids = token_ids()
    block = model.model.language_model.layers[1].mlp
    gate_up, norm = block.experts.gate_up_proj, block.experts.post_expert_norm
    _refused_until_adapted(model, ids, "Muse Spark's experts norm each route's output inside the experts module")
    with torch.no_grad():
        expected = model(ids).logits
        assert list(experts_modules(model)) == [f"model.language_model.layers.{i}.mlp.experts" for i in (1, 2)]
        assert type(block).__name__ == "MuseSparkNormedMoe" and block.post_expert_norm is norm
        assert isinstance(block.experts.post_expert_norm, torch.nn.Identity) and block.experts.gate_up_proj is gate_up
        torch.testing.assert_close(adapt_model(model)(ids).logits, expected, rtol=1e-6, atol=1e-6)
        torch.save(model, tmp_path / "model.pt")
        reloaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not traced_unadapted(reloaded)
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_jetmoe_in_fp32_on_the_gpu_replays_its_steps_as_generate(tiny):
    """fp32 JetMoE on the GPU: its attention experts' products without grouped_mm (`_every_expert_linear`) inside the
    steps' CUDA graphs (optimize's default mode there), the tokens transformers' own."""
    model = tiny("jetmoe").cuda()
    ids = token_ids().cuda()
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(dflash_compile.optimize(model).generate(ids, max_new_tokens=12), expected)


def test_qwen3_omni_is_optimized_through_its_thinker():
    """Qwen3-Omni's whole model (its thinker, and the talker that would speak) is refused before anything changes,
    naming the fix; its thinker is the family's (the image-text release test generates with a tiny one)."""
    with torch.device("meta"):
        model = transformers.Qwen3OmniMoeForConditionalGeneration(
            transformers.Qwen3OmniMoeConfig(enable_audio_output=False))
    message = ("model_type 'qwen3_omni_moe' generates text with its `thinker` and speech with its talker, which "
               "dflash-compile does not run: optimize the thinker, dflash_compile.optimize(model.thinker, ...)")
    with pytest.raises(UnsupportedFamilyError, match=re.escape(message)):
        dflash_compile.optimize(model)
    assert spec_for_model(model.thinker) is FAMILIES["qwen3_omni_moe"]
