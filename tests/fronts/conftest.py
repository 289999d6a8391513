"""Fixtures of the user-tries tests (tests/fronts/test_user_tries_*.py)."""

import pytest
import torch.distributed as dist

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def alone(monkeypatch):
    """This process as a plain ``python script.py``: no launcher's variables, no process group."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
