"""An optimizer with state over an elastic state's model but left out of the state is refused at its
first step (phalanx.elastic.unheld): after a grow the newcomer would start it afresh and the replicas
drift apart silently. One process; the 2 → 3 grow that showed the drift is in the module docstring."""

import gc

import pytest
import torch

from phalanx import elastic
from phalanx.parallel.data.delegation import WrapsOptimizer

pytestmark = pytest.mark.unit


def _step(model, opt):
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


class _Wrapper(WrapsOptimizer):  # what px.DistributedOptimizer is to torch: .state is the wrapped one's
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_an_optimizer_with_state_left_out_of_the_state_is_one_line(tmp_path):
    model = torch.nn.Linear(3, 1)
    state = elastic.TorchState(model, commit_dir=str(tmp_path / "a"), step=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^elastic.TorchState: Adam steps the state's model .* "
                                         r"pass it: TorchState\(model, optimizer, \.\.\.\)$"):
        _step(model, opt)
    del state


def test_held_stateless_unrelated_and_wrapped_optimizers_pass(tmp_path):
    a, b, other = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    held = torch.optim.Adam(a.parameters(), lr=0.1)
    inner = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    states = [elastic.TorchState(a, held, commit_dir=str(tmp_path / "a"), step=0),
              elastic.TorchState(b, optimizer=_Wrapper(inner), commit_dir=str(tmp_path / "b"))]
    _step(a, held)                                              # in the state
    _step(b, inner)                                             # its wrapper is in the state
    _step(a, torch.optim.SGD(a.parameters(), lr=0.1))           # no state to lose
    _step(other, torch.optim.Adam(other.parameters(), lr=0.1))  # not a state's model
    del states
    gc.collect()                                                # the states gone: nothing is checked
    _step(a, torch.optim.Adam(a.parameters(), lr=0.1))
