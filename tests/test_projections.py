"""`share_storage`: each family's groups of linear layers on one input (q/k/v, gate/up) laid out in one buffer,
with the same values and no extra memory; the compiled model then runs one linear per group."""

import tempfile

import pytest
import torch
import transformers

from dflash_compile.projections import share_storage
from tests.conftest import FAMILIES, ONE_LINEAR_PROJECTIONS, token_ids


def storage_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in ONE_LINEAR_PROJECTIONS])
def test_groups_share_one_buffer_with_the_same_values(tiny, family):
    """Laid out once, in the memory the layers held; the compiled model's one linear per group is
    tests/test_backend.py::test_one_dispatch_node_per_moe_layer_whatever_experts_implementation's."""
    model = tiny(family)
    ids = token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    memory = storage_bytes(model)
    groups = share_storage(model)
    assert groups > 0 and share_storage(model) == 0  # laid out once
    assert storage_bytes(model) == memory
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_a_laid_out_model_saves_and_loads_as_before(tiny):
    model = tiny("qwen3_moe")
    share_storage(model)
    ids = token_ids()
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model.save_pretrained(tmp)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp)
        assert torch.equal(loaded(ids).logits, model(ids).logits)
