"""The copy kernel of the device-managed expert cache: listed blobs land in their slots, nothing else changes."""

import pytest
import torch

from dflash_compile.kernels.blob_copy import BLOCK, copy_blobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("programs", [1, 2, None])  # one program walks every chunk; two interleave; the default
def test_listed_blobs_land_in_their_slots(programs):
    nbytes = 4 * (BLOCK + 100)  # two chunks per blob, the second partly masked
    host = torch.randint(0, 256, (5, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    host = host.pin_memory() if DEVICE == "cuda" else host
    pool = torch.zeros(3, nbytes, dtype=torch.uint8, device=DEVICE)
    experts = torch.tensor([4, 1, 2], device=DEVICE)
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    valid = torch.tensor([1, 1, 0], dtype=torch.int32, device=DEVICE)
    copy_blobs(host, pool, experts, slots, valid, programs)
    assert torch.equal(pool[2].cpu(), host[4]) and torch.equal(pool[0].cpu(), host[1])
    assert not pool[1].any()  # the row that is not valid copied nothing


def test_blob_sizes_must_agree():
    with pytest.raises(ValueError, match="blobs of 8 bytes into slots of 12: expected equal sizes"):
        copy_blobs(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 12, dtype=torch.uint8),
                   torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.int32))
