"""The commit's vote (phalanx.elastic.vote): a commit between two votes makes no round."""

import datetime

import pytest
import torch.distributed as dist

from phalanx.elastic import inprocess, vote
from phalanx.elastic import worker_context as wctx


@pytest.fixture
def worker(monkeypatch):
    """This process plays an elastic worker of a store of its own, and leaves no context behind."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv(inprocess.STORE_ENV, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(inprocess.WID_ENV, "w0")
    wctx.forget()
    yield wctx.current()
    wctx.forget()


class Ticks:
    """Stands in for rank 0's pending poll: counts the commits it is told of."""

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1


def test_commits_between_two_votes_skip_the_round_and_count_down_to_the_next_vote(worker):
    assert not vote.skips_vote()   # no vote answered yet: the first commit votes
    worker.skip = 3                # a vote's answer: skip the next three commits
    assert [vote.skips_vote() for _ in range(4)] == [True, True, True, False]
    assert worker.skip == 0


def test_a_vote_in_flight_is_read_by_commit_round_not_skipped(worker):
    # the commit after a voting one waits for that vote's answer, which sets the next skip count
    worker.skip, worker.vote = 5, ("work", "answer")
    assert not vote.skips_vote() and worker.skip == 5


def test_rank_0_times_every_skipped_commit(worker):
    # rank 0's count of commits per vote period is timed commit by commit, skipped commits included
    worker.pending, worker.skip = Ticks(), 2
    vote.skips_vote(), vote.skips_vote(), vote.skips_vote()
    assert worker.pending.ticks == 2


def test_outside_an_elastic_worker_nothing_is_skipped(monkeypatch):
    wctx.forget()
    monkeypatch.delenv(inprocess.STORE_ENV, raising=False)
    assert not vote.skips_vote()
    assert vote.commit_round(deferred=True) == (None, None)   # and a commit makes no round either
