"""The test harness itself: results in rank order, hang reports with stacks, timeouts."""

import time

import pytest
import torch

import phalanx as px
from phalanx.testing import RankTimeoutError, assert_same_on_all_ranks, distributed

pytestmark = pytest.mark.ranks


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


def test_device_under_test_switch_is_checked(monkeypatch):
    from phalanx.settings import SettingsError
    from phalanx.testing import device_under_test

    monkeypatch.delenv("PHALANX_TEST_DEVICE", raising=False)
    assert device_under_test() == "cpu"
    monkeypatch.setenv("PHALANX_TEST_DEVICE", "gpu")
    with pytest.raises(SettingsError, match="PHALANX_TEST_DEVICE='gpu' is not accepted; accepted: cpu | cuda"):
        device_under_test()
    if not torch.cuda.is_available():
        monkeypatch.setenv("PHALANX_TEST_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="PHALANX_TEST_DEVICE=cuda but torch sees no CUDA device"):
            distributed(_rank_tensor, np=2)


def _draws():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)                      # nn.init's kaiming_uniform_ / uniform_
    torch.nn.init.normal_(layer.weight)
    g = torch.Generator().manual_seed(1)               # a CPU generator, as the tests seed them
    x = torch.randn(5, 4, generator=g)
    order = torch.randperm(5, generator=g)
    noise = torch.empty(3).normal_()
    return [layer.weight, layer.bias, x, order, noise]


def test_device_under_test_makes_the_test_tensors_there_with_the_cpu_random_numbers():
    """The mode of PHALANX_TEST_DEVICE=cuda, checked on the meta device (no GPU here): the test's
    tensors land on the device, the CPU generators advance exactly as in the CPU run (so the
    weights and batches copied there are the CPU run's), and tensors made by phalanx's library
    code stay where a user's run makes them (on the CPU), so a CPU tensor meeting a CUDA one in
    library code still fails under the switch instead of being hidden."""
    from phalanx.parallel.data.followups import FiniteGuard
    from phalanx.testing.device import DeviceUnderTest, to_cpu

    reference = _draws()
    after = torch.randn(3)
    with DeviceUnderTest(torch.device("meta")):
        moved = _draws()
        library = FiniteGuard(None, [])._nonfinite   # made by library code, no parameters given
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        opt = torch.optim.AdamW([p])
        opt.step()                                    # torch's own bookkeeping: its step count
    assert [t.device.type for t in moved] == ["meta"] * 5
    # as in a user's CUDA run: the moments beside the parameter, the step count on the CPU (the
    # H100 run once found it on the GPU, an artefact of the switch, not of phalanx)
    assert opt.state[p]["exp_avg"].device.type == "meta" and opt.state[p]["step"].device.type == "cpu"
    assert torch.equal(torch.randn(3), after)         # the same number of draws from the same streams
    assert library.device.type == "cpu"
    assert to_cpu({"a": [reference[0]], "b": (1, reference[2])})["b"][1] is reference[2]
