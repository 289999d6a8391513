"""Test helpers: run a test body on N real ranks under plain pytest.

Example::

    from phalanx.testing import distributed

    def _body(scale):
        import phalanx as px, torch
        return px.allreduce(torch.ones(1), op=px.Sum).item() * scale

    def test_sum():
        assert distributed(_body, np=2, args=(3,)) == [6.0, 6.0]
"""

from phalanx.launcher.spawn import RankError, RankTimeoutError
from phalanx.testing.harness import (
           assert_same_on_all_ranks,
           device_under_test,
           distributed,
           world_sizes,
)

__all__ = ["distributed", "world_sizes", "assert_same_on_all_ranks", "device_under_test", "RankError",
           "RankTimeoutError"]
