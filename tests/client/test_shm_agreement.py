"""The engine ranks' shared-memory agreement, in real processes: the same answers as gloo's all-reduce,
agreement after agreement, and a clear error (not a hang) when a peer stops stepping."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from dspark_sidecar.client.shm_agreement import MAX_VALUES, ShmAgreement
from helpers.agreement_ranks import free_port, ranks, stalling

@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_element_wise_minimum_of_all_ranks(world):
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ranks, args=(world, free_port(), world, errors), nprocs=world, join=True)
    assert errors.empty()


def test_a_peer_that_stops_stepping_is_an_error_naming_it_not_a_hang():
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(stalling, args=(free_port(), errors), nprocs=2, join=True)
    msg = errors.get()
    assert "engine ranks [1] did not reach step agreement 2 within 0.5 s" in msg


def test_too_many_values_are_refused_before_anything_is_written():
    agree = ShmAgreement.__new__(ShmAgreement)  # the check comes first: no group needed
    agree._seq = 0
    with pytest.raises(ValueError, match=f"at most {MAX_VALUES}"):
        agree.all_min_ints(list(range(MAX_VALUES + 1)))
    assert agree._seq == 0
