"""Preemption: one checkpoint at the same step on every rank, exit 85, bitwise-equal resume.

End to end (two ``phalanx run -np 2`` launches of tests/jobs/preempt_job.py, shared by the checks
below): a plain loop where only rank 0 gets SIGTERM, and a Trainer stopped by SIGUSR1 sent to
``phalanx run --preempt-signal USR1`` while rank 0 is inside a step; then the same job again as a
requeued SLURM job (``SLURM_RESTART_COUNT=1``, no flag) resumes both and must end with
parameters bitwise equal to uninterrupted runs made in the first launch. In-process: signal
parsing, the SLURM requeue decision against a fake ``scontrol`` on PATH, checkpoint ordering.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from phalanx import runtime
from phalanx.checkpoint import CheckpointManager, list_checkpoints, read_manifest
from phalanx.launcher.forward import all_preempted, preempt_signals, torchelastic_signals
from phalanx.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption, signals, slurm

pytestmark = pytest.mark.ranks

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "preempt_job.py")
PHALANX = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--preempt-signal", "USR1"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempt")
    first = subprocess.Popen(PHALANX + [sys.executable, JOB, str(out), "first"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "waiting").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if first.poll() is None:
        first.send_signal(signal.SIGUSR1)  # to phalanx run only: it must forward it
    stdout, stderr = first.communicate(timeout=300)
    env = dict(os.environ, SLURM_RESTART_COUNT="1")
    second = subprocess.run(PHALANX + [sys.executable, JOB, str(out), "resume"], capture_output=True, text=True,
                            timeout=300, env=env)
    return {"out": out, "first": (first.returncode, stdout, stderr), "second": second}


def _notes(out, what):
    return [json.loads((out / f"{what}.{r}.json").read_text()) for r in (0, 1)]


def _params_equal(out, what):
    ref, resumed = torch.load(out / f"{what}_ref.pt"), torch.load(out / f"{what}_resumed.pt")
    return {k: torch.equal(ref[k], resumed[k]) for k in ref}


def test_phalanx_run_forwards_usr1_and_exits_75(job):
    code, _, stderr = job["first"]
    assert code == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "preempted by SIGUSR1" in stderr, stderr[-3000:]


def test_plain_loop_one_checkpoint_at_the_same_step(job):
    out = job["out"]
    stops = _notes(out, "plain_stop")
    assert stops[0]["step"] == stops[1]["step"] and stops[0]["path"] == stops[1]["path"], stops
    assert [s["code"] for s in stops] == [PREEMPTED_EXIT_CODE] * 2
    found = list_checkpoints(str(out / "plain_ckpt"))
    assert found == [stops[0]["path"]], found
    assert read_manifest(found[0])["meta"]["step"] == stops[0]["step"]


def test_trainer_one_checkpoint_at_the_same_step(job):
    out = job["out"]
    stops = _notes(out, "trainer_stop")
    assert stops[0]["path"] is not None and stops[0] == stops[1], stops
    assert stops[0]["signal"] == "SIGUSR1"
    meta = read_manifest(stops[0]["path"])["meta"]
    assert meta["preempted"] is True and meta["batch"] > 0, meta  # saved inside an epoch


def test_requeued_run_resumes_without_a_flag(job):
    second = job["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr


def test_plain_loop_resume_is_bitwise_equal(job):
    assert all(_params_equal(job["out"], "plain").values())


def test_trainer_resume_is_bitwise_equal(job):
    out = job["out"]
    assert all(_params_equal(out, "trainer").values())
    resumed = _notes(out, "trainer_resumed")[0]
    assert resumed["resumed"] == _notes(out, "trainer_stop")[0]["path"]
    assert resumed["history"] == _notes(out, "trainer_ref")[0]["history"]  # the split epoch's mean loss too


# ----------------------------------------------------------------------------- in one process


def test_signal_names():
    assert signals.parse_signal("USR1") == signal.SIGUSR1 == signals.parse_signal("sigusr1")
    assert signals.parse_signal(str(int(signal.SIGUSR2))) == signal.SIGUSR2
    with pytest.raises(ValueError, match="--preempt-signal 'NOPE' is not a signal name"):
        signals.parse_signal("NOPE")
    assert signals.from_env({"PHALANX_PREEMPT_SIGNAL": "USR1"}) == [signal.SIGTERM, signal.SIGUSR1]
    assert signals.from_env({}) == [signal.SIGTERM]


def test_agents_learn_the_preempt_signal_from_the_job_environment():
    # an agent started over SSH or srun gets --preempt-signal only through the workers' environment
    assert preempt_signals((signal.SIGTERM,), {"PHALANX_PREEMPT_SIGNAL": "USR1"}) == (signal.SIGTERM, signal.SIGUSR1)
    assert preempt_signals((signal.SIGTERM,), {}) == (signal.SIGTERM,)
    assert torchelastic_signals((signal.SIGTERM, signal.SIGUSR1)) == "SIGINT,SIGHUP,SIGQUIT"  # ours, not its


def test_launcher_reads_exit_codes():
    assert all_preempted([85, 85])
    assert all_preempted([85, -signal.SIGTERM])  # one 85 means every rank had saved; the rest was stopped
    assert not all_preempted([85, 1]) and not all_preempted([-signal.SIGUSR1] * 2) and not all_preempted([])


def test_preemption_checkpoints_inside_an_epoch_sort_between_epochs(tmp_path):
    for name in ("epoch-000000001", "epoch-000000002-batch-000000003", "epoch-000000002", "epoch-000000003-batch-000000001"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == [
        "epoch-000000003-batch-000000001", "epoch-000000002", "epoch-000000002-batch-000000003", "epoch-000000001"]
    CheckpointManager(str(tmp_path), keep=2).prune()
    assert sorted(os.listdir(tmp_path)) == ["epoch-000000002", "epoch-000000003-batch-000000001"]


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """``scontrol`` on PATH that logs its arguments; ``show job`` prints Requeue=$FAKE_REQUEUE."""
    log = tmp_path / "scontrol.log"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                      'if [ "$1" = show ]; then echo "JobId=$3 JobName=t Requeue=${FAKE_REQUEUE:-1} Restarts=0"; fi\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    for var in ("PHALANX_REQUEUE", "SLURM_RESTART_COUNT", "PHALANX_RESUME_FROM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return log


def _calls(log):
    return log.read_text().splitlines() if log.exists() else []


def test_requeue_decision(fake_scontrol, monkeypatch):
    usr1 = signal.SIGUSR1
    assert slurm.requeue_wanted(usr1) and _calls(fake_scontrol) == ["show job -o 4242"]  # auto: Requeue=1
    assert not slurm.requeue_wanted(signal.SIGTERM)  # SLURM is ending the job itself
    monkeypatch.setenv("FAKE_REQUEUE", "0")
    assert not slurm.requeue_wanted(usr1)  # sbatch --no-requeue
    monkeypatch.setenv("PHALANX_REQUEUE", "1")
    assert slurm.requeue_wanted(usr1)  # phalanx run --requeue
    monkeypatch.setenv("PHALANX_REQUEUE", "0")
    assert not slurm.requeue_wanted(usr1)  # --no-requeue
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("PHALANX_REQUEUE", "1")
    assert not slurm.requeue_wanted(usr1) and not slurm.requeue()  # outside SLURM: only the exit status



def test_requeue_ended_by_slurm_counts_as_accepted(fake_scontrol, monkeypatch):
    # SLURM ends the job's processes as it requeues the job, sometimes scontrol too (a child of rank 0)
    # before it answers: ended by a signal is accepted (seen: "refused: " with nothing said, yet requeued)
    script = fake_scontrol.parent / "bin" / "scontrol"
    script.write_text(script.read_text() + 'if [ "$1" = requeue ]; then kill -TERM $$; fi\n')
    assert slurm.requeue() and _calls(fake_scontrol) == ["requeue 4242"]
    script.write_text(script.read_text().replace("kill -TERM $$", "echo 'Job is no longer pending' >&2; exit 1"))
    assert not slurm.requeue()  # a refusal that says so stays a refusal

def test_save_requeue_exit_in_one_process(fake_scontrol, tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "step": 0}
    signals.clear()
    before = signal.getsignal(signal.SIGUSR1)  # another module's library (Ray Tune) may have set one
    with Preemption(["USR1"]) as preempt:
        assert not preempt.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.requested() and preempt.signal == signal.SIGUSR1
        with pytest.raises(Preempted) as caught:
            preempt.save_and_exit(mgr, 3, state)
    signals.clear()
    runtime.exit_after_hooks(None)  # this test process goes on: cancel the exit with 85 that Preempted set
    assert caught.value.code == PREEMPTED_EXIT_CODE and caught.value.requeued
    assert caught.value.path == mgr.path(3) and list_checkpoints(mgr.root) == [mgr.path(3)]
    assert _calls(fake_scontrol)[-1] == "requeue 4242"
    assert signal.getsignal(signal.SIGUSR1) == before  # handlers given back
    # a requeued run (SLURM_RESTART_COUNT > 0) loads it without any flag; a fresh one does not
    fresh = {"model": torch.nn.Linear(3, 2), "step": 0}
    assert Preemption().resume(mgr, fresh) is None and fresh["step"] == 0
    os.environ["SLURM_RESTART_COUNT"] = "1"
    try:
        assert Preemption().resume(mgr, fresh) == mgr.path(3) and fresh["step"] == 0
        assert torch.equal(fresh["model"].weight, model.weight)
    finally:
        del os.environ["SLURM_RESTART_COUNT"]


def test_bad_preempt_signal_flag_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "1", "--preempt-signal", "USR9", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--preempt-signal 'USR9' is not a signal name" in proc.stderr, proc.stderr


def test_sbatch_level_launcher_leaves_the_signal_to_srun_and_exits_with_its_status(capsys):
    # phalanx run as the batch step (launcher/slurm.py): USR1 goes on to srun, whose 85 it returns.
    # The fake srun signals this process until the launcher's handler passes USR1 back to it.
    import threading

    from phalanx.launcher.slurm import _pump, _supervise

    fake_srun = ("import os, signal, sys, time\n"
                 "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(85))\n"
                 "for _ in range(600):\n    os.kill(os.getppid(), signal.SIGUSR1)\n    time.sleep(0.05)\n"
                 "sys.exit(3)\n")  # never passed back
    before = signal.signal(signal.SIGUSR1, lambda *a: None)  # until _supervise installs its own
    try:
        proc = subprocess.Popen([sys.executable, "-c", fake_srun], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stdout), daemon=True)
        pump.start()
        code = _supervise(proc, pump, (signal.SIGTERM, signal.SIGUSR1))
    finally:
        signal.signal(signal.SIGUSR1, before)
    err = capsys.readouterr().err
    assert code == PREEMPTED_EXIT_CODE and proc.returncode == PREEMPTED_EXIT_CODE, err
    assert "received SIGUSR1; srun passes it" in err and "preempted by SIGUSR1" in err, err
