"""The CUDA kernel of `dflash::top_k` (kernels/top_k.py) against torch.topk."""

import pytest
import torch

from dflash_compile.kernels.top_k import top_k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape, k", [((37, 32), 4), ((2, 3, 128), 8), ((5, 256), 8), ((3, 7), 7), ((4, 40), 32),
                                      ((0, 32), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_torch_topk(shape, k, dtype):
    """Distinct values (no ties): the same values, in the same order, at the same indices; any leading shape, rows
    not filling the last program, k up to the width, no rows at all."""
    ranks = torch.rand(shape, generator=torch.Generator().manual_seed(0)).argsort(dim=-1)
    x = (ranks - shape[-1] // 2).to(dtype)  # each row a permutation of integers, exact in bf16
    values, indices = top_k(x.to(DEVICE), k)
    expected_values, expected_indices = torch.topk(x, k, dim=-1)
    assert values.dtype == dtype and indices.dtype == torch.int64 and values.shape == (*shape[:-1], k)
    assert torch.equal(values.cpu(), expected_values) and torch.equal(indices.cpu(), expected_indices)


@pytest.mark.parametrize("renormalize, values_dtype", [(False, None), (True, None), (True, torch.bfloat16),
                                                       (False, torch.bfloat16)])
@pytest.mark.parametrize("shape, k", [((37, 128), 8), ((2, 3, 60), 4), ((0, 32), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_routers_steps_match_torch(shape, k, dtype, renormalize, values_dtype):
    """The top k of torch.softmax(x, dim=-1, dtype=float32) as routers take them, the chosen probabilities divided
    by their sum and cast, each or not: the same experts in the same order, the values within fp32 rounding (rows
    not a power of two wide, no rows at all)."""
    ranks = torch.rand(shape, generator=torch.Generator().manual_seed(1)).argsort(dim=-1)
    x = ((ranks - shape[-1] // 2) / 8).to(dtype)  # distinct scores, exact in bf16
    values, indices = top_k(x.to(DEVICE), k, torch.float32, renormalize, values_dtype)
    expected_values, expected_indices = torch.topk(torch.softmax(x, dim=-1, dtype=torch.float32), k, dim=-1)
    if renormalize:
        expected_values /= expected_values.sum(dim=-1, keepdim=True)
    expected_values = expected_values.to(values_dtype or torch.float32)
    assert values.dtype == expected_values.dtype and torch.equal(indices.cpu(), expected_indices)
    torch.testing.assert_close(values.cpu(), expected_values, rtol=1e-5 if values_dtype is None else 1e-2, atol=0)


def test_equal_values_come_in_index_order_and_nan_ranks_with_inf():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 1.0],  # three 2s: indices 1, 2, 4 in that order, then the first 1
                      [-inf, 3.0, -inf, nan, -inf, 0.0],  # NaN, 3, 0, then -inf by index
                      [-inf] * 6,
                      [-0.0, 0.0, -1.0, -0.0, -2.0, 0.0]])  # -0.0 equals 0.0: the four zeros by index
    values, indices = top_k(x.to(DEVICE), 4)
    assert indices.tolist() == [[1, 2, 4, 0], [3, 1, 5, 0], [0, 1, 2, 3], [0, 1, 3, 5]]
    assert torch.equal(values.cpu().nan_to_num(), x.gather(1, indices.cpu()).nan_to_num())
    assert values[1, 0].isnan()


@pytest.mark.skipif(DEVICE == "cpu", reason="torch.topk's choice among equal values on CUDA is the reference")
def test_among_equal_values_the_same_experts_as_torch_topk_on_cuda():
    """bf16 scores with many ties at the k-th value: the same chosen set as torch's radix select (lowest indices
    first), so routing matches the eager model's; values in the same order."""
    scores = torch.randint(-3, 4, (4096, 32), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    values, indices = top_k(scores.cuda(), 4)
    expected_values, expected_indices = torch.topk(scores.cuda(), 4, dim=-1)
    assert torch.equal(values, expected_values)
    assert torch.equal(indices.sort(dim=-1).values, expected_indices.sort(dim=-1).values)
