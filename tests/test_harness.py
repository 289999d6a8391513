"""The test harness itself: results in rank order, hang reports with stacks, timeouts."""

import time

import pytest
import torch

import phalanx as px
from phalanx.testing import RankTimeoutError, assert_same_on_all_ranks, distributed


def _sleep_on_rank_zero():
    if px.rank() == 0:
        time.sleep(60)  # this line must show up in the hang report
    px.barrier()


def test_hang_is_killed_and_reported_with_the_stack():
    # rank 0 sleeps 60 s: returning at all (pytest-timeout guards the file) means the harness killed
    # it at the 5 s deadline; no wall-clock assertion (on a loaded machine the forkserver's start varies)
    with pytest.raises(RankTimeoutError) as info:
        distributed(_sleep_on_rank_zero, np=2, timeout=5)
    msg = str(info.value)
    assert "did not finish within 5s" in msg
    assert "--- rank 0 stack ---" in msg and "_sleep_on_rank_zero" in msg


def _rank_tensor():
    return {"w": torch.ones(2) * px.size()}


def test_results_in_rank_order_and_equality_helper():
    results = distributed(_rank_tensor, np=3)
    assert len(results) == 3
    assert_same_on_all_ranks(results)
    with pytest.raises(AssertionError, match="rank 1"):
        assert_same_on_all_ranks([{"w": torch.zeros(1)}, {"w": torch.ones(1)}])


def test_run_rejects_bad_sizes():
    with pytest.raises(ValueError, match="np"):
        px.run(_rank_tensor, np=0)
    with pytest.raises(ValueError, match="local_size"):
        px.run(_rank_tensor, np=3, local_size=2)
