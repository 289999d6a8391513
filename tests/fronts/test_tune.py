"""phalanx.tune: an Optuna study whose trials are 2-rank jobs (every rank follows rank 0's
suggestions and pruning; the SQLite study survives its driver). The Ray Tune run whose trials are
RayExecutor jobs stopped early by ASHA is in test_ray.py, on that module's local Ray cluster."""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

optuna = pytest.importorskip("optuna", reason="optuna is not installed (pip install 'phalanx[tune]')")

import phalanx as px  # noqa: E402
from phalanx.tune import DistributedTrial, run_study, trials_table  # noqa: E402

EPOCHS = 3
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]  # a local cluster and several jobs: minutes when the machine is loaded


def objective(trial, epochs, sleep_s=0.0):
    """value at epoch e = x * (e + 1), computed with a collective; every rank checks it follows rank 0."""
    x = trial.suggest_float("x", 0.0, 1.0)
    kind = trial.suggest_categorical("kind", ["a", "b"])
    followed = px.allgather_object((x, kind, trial.number))
    if len(set(followed)) != 1:
        raise AssertionError(f"ranks disagree on the trial: {followed}")
    value = 0.0
    for epoch in range(epochs):
        time.sleep(sleep_s)
        value = px.allreduce(torch.tensor([x * (epoch + 1)], dtype=torch.float64), op=px.Average).item()
        trial.report(value, epoch)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


def test_import_phalanx_imports_neither_ray_nor_optuna():
    code = ("import sys, phalanx, phalanx.horovod\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'optuna')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_distributed_trial_in_a_world_of_one():
    study = optuna.create_study()
    trial = DistributedTrial(study.ask())
    assert 0 <= trial.suggest_int("n", 0, 3) <= 3
    trial.report(1.0, 0)
    assert trial.should_prune() is False and trial.number == 0 and set(trial.params) == {"n"}
    with pytest.raises(ValueError, match="rank 0 must pass"):
        DistributedTrial(None)


def test_optuna_study_of_two_rank_trials_with_pruning_and_resume(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    common = dict(ranks_per_trial=2, args=(EPOCHS,), study_name="t", storage=url, direction="minimize",
                  sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.ThresholdPruner(upper=1.5),
                  slots=2)
    # x=0.9 crosses 1.5 at epoch 1 (1.8): pruned after two reports; x=0.2 completes at 0.6
    study = run_study(objective, n_trials=3, enqueue=[{"x": 0.2, "kind": "a"}, {"x": 0.9, "kind": "b"}], **common)
    trials = study.get_trials()
    assert len(trials) == 3
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].value == pytest.approx(0.6)
    assert trials[0].intermediate_values == pytest.approx({0: 0.2, 1: 0.4, 2: 0.6})
    assert trials[1].state == optuna.trial.TrialState.PRUNED and sorted(trials[1].intermediate_values) == [0, 1]
    assert trials[2].state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    table = trials_table(study)
    assert "| 1 | PRUNED | b | 0.9 |" in table, table

    # a new driver on the same storage: it finds 3 finished trials and runs only the 4th
    again = run_study(objective, n_trials=4, **common)
    assert [t.number for t in again.get_trials()] == [0, 1, 2, 3]
    assert again.get_trials()[3].state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


_CRASHING_DRIVER = """
import optuna, sys, test_tune
from phalanx.tune import run_study
run_study(test_tune.objective, n_trials=5, ranks_per_trial=2, args=(3, 20.0), study_name="c", storage=sys.argv[1],
          direction="minimize", heartbeat_s=1, slots=2)
"""


def test_study_survives_a_killed_driver(tmp_path):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs"),
                                            os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_DRIVER, url], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    storage = optuna.storages.RDBStorage(url)
    try:
        deadline = time.monotonic() + 120
        running = []
        while time.monotonic() < deadline and not running:
            time.sleep(0.5)
            try:
                running = optuna.load_study(study_name="c", storage=storage).get_trials(
                    states=[optuna.trial.TrialState.RUNNING])
            except KeyError:  # the study is not created yet
                pass
            assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert running, "the driver never started a trial"
        # Optuna only fails a RUNNING trial whose last heartbeat is stale: wait for the first one
        # (a fixed sleep was not enough on a loaded machine)
        db = sqlite3.connect(str(tmp_path / "crash.db"))
        while time.monotonic() < deadline and not db.execute("SELECT count(*) FROM trial_heartbeats").fetchone()[0]:
            time.sleep(0.2)
        db.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its ranks, mid-trial
        proc.wait()
    # past the grace period (3 heartbeats) by more than SQLite's one-second clock: CURRENT_TIMESTAMP
    # keeps whole seconds, so 3.5 s after a beat at x.9 can read as exactly 3 s, which is not stale
    time.sleep(5.0)
    study = run_study(objective, n_trials=1, ranks_per_trial=2, args=(1,), study_name="c", storage=url,
                      direction="minimize", heartbeat_s=1, slots=2)
    states = [t.state for t in study.get_trials()]
    assert states[0] == optuna.trial.TrialState.FAIL, "the killed driver's trial was not marked FAIL"
    assert states[1] == optuna.trial.TrialState.COMPLETE
