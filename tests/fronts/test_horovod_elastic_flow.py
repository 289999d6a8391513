"""Horovod's own elastic test flow through `phalanx run` (issue 32): tests/jobs/hvd_flow_job.py, a Horovod
script in the shape of Horovod's elastic_torch_main.py (hvd.elastic.TorchState with a DistributedOptimizer,
register_reset_callbacks, a commit every batch, rank 0's `state._host_messages` wait), launched with
horovodrun's flags and a discovery script that, as in Horovod's elastic_common.py, reads the epoch from
the logfile's row count. Each test is one of elastic_common.py's scenarios, one `phalanx run` each, and
checks the rows it asserts (epoch, size, rendezvous, hostname, start_rank), here for every row."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.ranks

JOB = Path(__file__).resolve().parent.parent / "jobs" / "hvd_flow_job.py"
HUI = "HostsUpdatedInterrupt"  # the class a Horovod script catches: hvd.elastic.HostsUpdatedInterrupt


def _discovery_script(path: Path, logfile: Path, schedule) -> Path:
    """A script printing the hosts of the epoch the logfile has reached ([epoch or None, hosts] steps;
    None: every later epoch, last)."""
    log = shlex.quote(str(logfile))
    lines = ["#!/bin/sh", "rows=0", f"[ -f {log} ] && rows=$(($(wc -l < {log})))", 'case "$rows" in']
    for epoch, hosts in schedule:
        lines.append(f"  {'*' if epoch is None else epoch}) printf '%s\\n' {' '.join(hosts)} ;;")
    path.write_text("\n".join([*lines, "esac", ""]))
    path.chmod(0o755)
    return path


def _run(tmp_path, schedule=None, hosts=None, exits=None, mode="exception", np=2, min_np=2, max_np=4,
         epochs=3, batches=2, timeout=150, flags_extra=(), job=()):
    """`phalanx run` as elastic_common.py runs horovodrun: with a discovery script, or with -H hosts
    (``flags_extra``: more of horovodrun's, e.g. --elastic-timeout; ``job``: more of the script's)."""
    logfile = tmp_path / "log.jsonl"
    flags = ["-np", str(np), "--min-num-proc", str(min_np)]
    if hosts is not None:
        flags += ["-H", hosts]
    else:
        script = _discovery_script(tmp_path / "discover.sh", logfile, schedule)
        flags += ["--host-discovery-script", str(script), "--max-num-proc", str(max_np)]
    flags += list(flags_extra)
    params, indices = tmp_path / "params", tmp_path / "indices"
    params.mkdir()
    indices.mkdir()
    cmd = [sys.executable, "-m", "phalanx", "run", *flags, "--timeout", "30", "python", str(JOB),
           "--logfile", str(logfile), "--epochs", str(epochs), "--batches-per-epoch", str(batches),
           "--params-dir", str(params), "--indices-dir", str(indices), *job]
    if schedule:
        cmd += ["--discovery-schedule", json.dumps(schedule)]
    if exits:
        cmd += ["--exit-schedule", json.dumps({str(k): v for k, v in exits.items()}), "--exit-mode", mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_ELASTIC_DIR": str(tmp_path / "commits")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line) for line in logfile.read_text().splitlines()] if logfile.exists() else []
    proc.report = ("rows:\n" + "\n".join(map(json.dumps, rows)) + f"\nstdout:\n{proc.stdout[-3000:]}"
                   f"\nstderr:\n{proc.stderr[-5000:]}")
    notices = [line for line in proc.stdout.splitlines() if "host-change notice" in line]
    if notices:  # how long rank 0 waited for the launcher's notice (the script allows 3 s)
        print("\n" + "; ".join(notices))
    return proc, rows, params


def _assert_rows(rows, expected, report, caught=None):
    """expected: (start_rank, size, hostname, rendezvous) per epoch, in order. ``caught``: per epoch, what
    rank 0's process caught as `except hvd.elastic.HostsUpdatedInterrupt` so far ([class name, skip_sync])."""
    got = [(r["epoch"], r["start_rank"], r["size"], r["hostname"], r["rendezvous"]) for r in rows]
    assert got == [(e, *row) for e, row in enumerate(expected)], report
    if caught is not None:
        assert [r["caught"] for r in rows] == caught, report


def _assert_samples(tmp_path: Path, epochs: int, report, batches=2):
    """Horovod's ElasticSampler semantics from every worker's noted steps: each (epoch, batch) taken once
    by every rank of its world; no sample of an epoch taken twice, none skipped, across resets (the
    samples taken are a prefix of the epoch's permutation, seed 0 + epoch)."""
    steps = [json.loads(line) for f in (tmp_path / "indices").iterdir() for line in f.read_text().splitlines()]
    for epoch in range(epochs):
        taken = []
        for batch in range(batches):
            here = [s for s in steps if (s["epoch"], s["batch"]) == (epoch, batch)]
            assert here and len(here) == here[0]["size"] and {s["size"] for s in here} == {len(here)}, \
                f"epoch {epoch} batch {batch}: {here}\n{report}"
            taken += [i for s in here for i in s["idx"]]
        assert len(taken) == len(set(taken)), f"epoch {epoch}: a sample taken twice: {sorted(taken)}\n{report}"
        order = torch.randperm(32, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert set(taken) == set(order[:len(taken)]), f"epoch {epoch}: samples skipped: {sorted(taken)}\n{report}"


def _assert_equal_replicas(params: Path, n: int, report):
    assert sorted(p.name for p in params.iterdir()) == [f"params.{r}.pt" for r in range(n)], report
    saved = [torch.load(params / f"params.{r}.pt", weights_only=True) for r in range(n)]
    for other in saved[1:]:
        assert all(torch.equal(a, b) for a, b in zip(saved[0], other)), report  # bitwise


def test_hosts_added_and_removed(tmp_path):
    # elastic_common.py (slots 2): localhost:2, then a second host 127.0.0.1:2, then only 127.0.0.1:2.
    # Rank 0 waits <= 3 s for state._host_messages after each logged epoch that changes the hosts.
    schedule = [[0, ["localhost:2"]], [1, ["localhost:2", "127.0.0.1:2"]], [None, ["127.0.0.1:2"]]]
    proc, rows, params = _run(tmp_path, schedule)
    assert proc.returncode == 0, proc.report
    # the grow's interrupt (skip_sync False: workers added) caught by the rank 0 of epoch 1, the shrink's
    # (skip_sync True: only removed) by the worker started as rank 2, rank 0 of epoch 2
    _assert_rows(rows, [(0, 2, "localhost", 1), (0, 4, "localhost", 2), (2, 2, "127.0.0.1", 3)], proc.report,
                 caught=[[], [[HUI, False]], [[HUI, True]]])
    assert proc.stdout.count("host-change notice") == 2, proc.report
    _assert_equal_replicas(params, 2, proc.report)
    _assert_samples(tmp_path, 3, proc.report)


def test_single_rank_failure(tmp_path):
    # the worker started as rank 0 raises at (epoch 1, batch 0): its host (localhost) is set aside with
    # both its workers; the job goes on with 127.0.0.1's two, the worker started as rank 2 now rank 0
    proc, rows, params = _run(tmp_path, [[None, ["localhost:2", "127.0.0.1:2"]]], exits={(1, 0): [0]})
    assert proc.returncode == 0, proc.report
    _assert_rows(rows, [(0, 4, "localhost", 1), (2, 2, "127.0.0.1", 2), (2, 2, "127.0.0.1", 2)], proc.report)
    assert "host localhost set aside" in proc.stderr and "scheduled exit at epoch 1 batch 0" in proc.stderr, \
        proc.report
    _assert_equal_replicas(params, 2, proc.report)
    _assert_samples(tmp_path, 3, proc.report)


def test_fault_tolerance_without_scaling(tmp_path):
    # -H instead of discovery, and the worker SIGKILLed (exit mode kill) instead of raising
    proc, rows, params = _run(tmp_path, hosts="localhost:2,127.0.0.1:2", exits={(1, 0): [0]}, mode="kill")
    assert proc.returncode == 0, proc.report
    _assert_rows(rows, [(0, 4, "localhost", 1), (2, 2, "127.0.0.1", 2), (2, 2, "127.0.0.1", 2)], proc.report)
    assert "killed by SIGKILL" in proc.stderr and "host localhost set aside" in proc.stderr, proc.report
    _assert_equal_replicas(params, 2, proc.report)
    _assert_samples(tmp_path, 3, proc.report)


def test_all_ranks_failure(tmp_path):
    # every worker raises at (1, 0): Horovod's "one or more processes exited with non-zero status";
    # phalanx run exits non-zero naming the first failure
    proc, rows, _ = _run(tmp_path, [[None, ["localhost:2", "127.0.0.1:2"]]], exits={(1, 0): [0, 1, 2, 3]},
                         timeout=240)
    assert proc.returncode != 0, proc.report
    assert "stopping the job (first failure: rank " in proc.stderr, proc.report
    _assert_rows(rows, [(0, 4, "localhost", 1)], proc.report)  # epoch 0 only


def test_hosts_added_and_removed_one_slot_per_host(tmp_path):
    # elastic_common.py's second parametrization (slots 1): localhost:1, then + 127.0.0.1:1, then 127.0.0.1:1
    schedule = [[0, ["localhost:1"]], [1, ["localhost:1", "127.0.0.1:1"]], [None, ["127.0.0.1:1"]]]
    proc, rows, params = _run(tmp_path, schedule, np=1, min_np=1, max_np=2)
    assert proc.returncode == 0, proc.report
    _assert_rows(rows, [(0, 1, "localhost", 1), (0, 2, "localhost", 2), (1, 1, "127.0.0.1", 3)], proc.report,
                 caught=[[], [[HUI, False]], [[HUI, True]]])
    assert proc.stdout.count("host-change notice") == 2, proc.report
    _assert_equal_replicas(params, 1, proc.report)
    _assert_samples(tmp_path, 3, proc.report)


def test_set_aside_host_returns_after_its_cooldown(tmp_path):
    # elastic_common.py's blacklist cooldown scenario: the worker started as rank 3 (on 127.0.0.1) raises, here
    # at (1, 1) so that the reset falls mid-epoch (the sampler re-deals the rest of epoch 1 to 2 ranks); the
    # host is set aside for 2..3 s, then comes back, and the job grows onto it again. Rank 0 waits after
    # epoch 1 for that host-change notice, so the rows do not depend on timing.
    proc, rows, params = _run(tmp_path, [[None, ["localhost:2", "127.0.0.1:2"]]], exits={(1, 1): [3]},
                              flags_extra=["--blacklist-cooldown-range", "2", "3"],
                              job=["--notice-after", "[1]", "--discovery-wait", "30"])
    assert proc.returncode == 0, proc.report
    # the failure is a lost peer (no interrupt); the host's return is a HostsUpdatedInterrupt at a commit
    _assert_rows(rows, [(0, 4, "localhost", 1), (0, 2, "localhost", 2), (0, 4, "localhost", 3)], proc.report,
                 caught=[[], [], [[HUI, False]]])
    assert "host 127.0.0.1 set aside for " in proc.stderr, proc.report
    assert "host 127.0.0.1 is back after its cooldown" in proc.stdout, proc.report
    assert proc.stdout.count("host-change notice") == 1, proc.report
    _assert_equal_replicas(params, 4, proc.report)
    _assert_samples(tmp_path, 3, proc.report)


def test_min_hosts_timeout(tmp_path):
    # --min-num-proc 4 of 4: the worker started as rank 0 raises at (1, 0), localhost is set aside, two
    # workers can run; discovery may bring hosts back, so the job waits --elastic-timeout, then stops
    proc, rows, _ = _run(tmp_path, [[None, ["localhost:2", "127.0.0.1:2"]]], exits={(1, 0): [0]}, np=4, min_np=4,
                         flags_extra=["--elastic-timeout", "2"])
    assert proc.returncode != 0, proc.report
    stopped = [line for line in proc.stderr.splitlines() if "--elastic-timeout 2s" in line]
    assert len(stopped) == 1, proc.report
    assert "fewer than --min-np 4" in stopped[0] and "127.0.0.1" in stopped[0] and "localhost" in stopped[0], \
        proc.report
    assert "first failure: rank 0 " in stopped[0], proc.report
    _assert_rows(rows, [(0, 4, "localhost", 1)], proc.report)  # epoch 0 only


def test_all_hosts_blacklisted(tmp_path):
    # one worker on each host raises at (1, 0) (started as ranks 0 and 2): both hosts are set aside, and
    # Horovod stops the job; so does phalanx run, at once, with one line saying so
    proc, rows, _ = _run(tmp_path, [[None, ["localhost:2", "127.0.0.1:2"]]], exits={(1, 0): [0, 2]},
                         timeout=120)
    assert proc.returncode != 0, proc.report
    stopped = [line for line in proc.stderr.splitlines() if "every host" in line]
    assert len(stopped) == 1 and "set aside" in stopped[0], proc.report
    assert "localhost" in stopped[0] and "127.0.0.1" in stopped[0], proc.report
    assert "(first failure: rank " in stopped[0], proc.report
    for start in (0, 2):  # each failing worker's traceback once (shown live; the launcher repeats none)
        assert proc.stderr.count(f"]: RuntimeError: scheduled exit at epoch 1 batch 0: started as rank {start}") == 1, \
            proc.report
    assert "falling back" not in proc.stderr, proc.report
    _assert_rows(rows, [(0, 4, "localhost", 1)], proc.report)  # epoch 0 only


def test_host_messages_follow_the_launchers_notices(monkeypatch, request):
    # in this process, against a store of our own: the queue fills from the launcher's notices, a
    # commit's check sees them (phalanx.elastic's own check does not) and raises HostsUpdatedInterrupt
    # with Horovod's skip_sync, a re-form empties the queue
    import datetime
    import queue

    import torch.distributed as dist

    from phalanx import elastic
    from phalanx.elastic import inprocess, vote
    from phalanx.horovod import elastic as hel
    from phalanx.launcher.host_notices import ADDED, HostNotices

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv(inprocess.STORE_ENV, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(inprocess.WID_ENV, "w0")
    monkeypatch.delenv(inprocess.JOIN_ENV, raising=False)
    from phalanx.elastic import worker_context

    worker_context.forget()  # this test plays a worker of its own store, and leaves none behind
    request.addfinalizer(worker_context.forget)
    notices = HostNotices(store)
    store.set("pxe/latest", "0")
    messages = hel.state.HostMessages()
    assert messages.empty() and vote.change_at_commit(notices=True) is None
    notices.post(ADDED)  # workers started on a new host
    assert not messages.empty() and messages.qsize() == 1
    stamp, update = messages.get_nowait()
    assert update is hel.HostUpdateResult.added and isinstance(stamp, float)
    assert messages.empty()  # each notice once
    assert vote.change_at_commit(notices=True) is not None and vote.change_at_commit() is None
    err = vote.change_at_commit(notices=True)  # what a commit raises: Horovod's class, and ours
    assert type(err) is hel.HostsUpdatedInterrupt and hel.HostsUpdatedInterrupt is elastic.HostsUpdatedInterrupt
    assert isinstance(err, inprocess.MembershipChanged) and isinstance(err, RuntimeError)
    assert err.reform and err.skip_sync is False  # workers added: the state must be synced to them
    user = hel.HostsUpdatedInterrupt("hosts changed")  # raised by a script: rolls back, does not re-form
    assert not user.reform and not user.skip_sync and str(user) == "hosts changed"
    assert hel.HostsUpdatedInterrupt(True).skip_sync and hel.HostsUpdatedInterrupt(skip_sync=True).skip_sync
    assert notices.pending and notices.cover(["w0"], ["w0", "w1"]) == 1 and not notices.pending
    notices.cover(["w0", "w1"], ["w1"])  # a shrink published without a notice before it: its own
    assert [u for _, _, u in inprocess.host_updates(1)] == [hel.HostUpdateResult.removed]
    ctx = worker_context.current()
    ctx.notice = 1  # this worker's generation covers notice 1: only the removal is pending
    assert vote.change_at_commit(notices=True).skip_sync
    gen = {0: ["w0", "w1"], 1: ["w1"]}  # a generation that drops w0: removed only
    for g, wids in gen.items():
        store.set(f"pxe/gen/{g}", json.dumps({"members": [[w, "localhost"] for w in wids]}))
    store.set("pxe/latest", "1")
    assert vote.change_at_commit().skip_sync
    store.set("pxe/gen/1", json.dumps({"members": [["w1", "localhost"], ["w2", "127.0.0.1"]]}))
    assert not vote.change_at_commit().skip_sync  # w2 is new: not removals only
    store.set("pxe/latest", "0")
    messages.put((0.0, hel.HostUpdateResult.mixed))
    ctx.gen, ctx.notice = 2, 2  # re-formed into a generation covering both notices
    assert messages.empty() and vote.change_at_commit(notices=True) is None
    with pytest.raises(queue.Empty):
        messages.get(timeout=0.2)


def test_two_states_in_one_job_keep_their_own_commits(tmp_path, monkeypatch):
    """Two hvd.elastic states on the shared default commit dir (issue 39): each commits, prunes and restores
    its own snapshots; a restarted process (fresh states, created in the same order) gets each one back."""
    import gc

    import phalanx.horovod as hvd

    monkeypatch.setenv("PHALANX_ELASTIC_DIR", str(tmp_path / "commits"))

    def states():
        torch.manual_seed(0)
        net, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
        return (hvd.elastic.TorchState(net, torch.optim.SGD(net.parameters(), lr=0.1), epoch=0, batch=0),
                hvd.elastic.TorchState(head, step=0))

    a, b = states()
    assert a.commit_dir != b.commit_dir and a.commit_dir == str(tmp_path / "commits")
    for i in range(3):  # a commits 3 times, b twice, interleaved (the same step numbers, different pieces)
        a.epoch, a.batch = 10 + i, i
        with torch.no_grad():
            a.model.weight.add_(1.0)
        a.commit()
        if i < 2:
            b.step = 100 + i
            with torch.no_grad():
                b.model.bias.fill_(float(i + 7))
            b.commit()
    want_a, want_b = a.model.weight.clone(), b.model.bias.clone()
    a.epoch, b.step = -1, -1
    assert a.restore() and b.restore() and (a.epoch, b.step) == (12, 101)  # from memory

    del a, b
    gc.collect()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted process: its states count from 1 again
    a2, b2 = states()  # no commit in memory, each reads its own snapshots
    assert a2.restore() and b2.restore()
    assert (a2.epoch, a2.batch, a2.commits, b2.step, b2.commits) == (12, 2, 3, 101, 2)
    assert torch.equal(a2.model.weight, want_a) and torch.equal(b2.model.bias, want_b)


def test_a_new_state_never_inherits_an_earlier_states_commit(tmp_path, monkeypatch):
    """Issue 39 (Horovod's Keras test_elastic_state after its TensorFlow one, in one process): a state
    made after another one with the same pieces and the same commit dir is gone starts from its own
    values; its sync() (no member holds a commit) and restore() find nothing of the earlier state's.
    The earlier state's commit still belongs to its own lineage: the first state of a restarted
    process gets it back. Reference: one process, the values each state was made with."""
    import gc

    from phalanx import elastic

    monkeypatch.setenv("PHALANX_ELASTIC_DIR", str(tmp_path / "commits"))

    def state(fill):
        net = torch.nn.Linear(2, 2)
        with torch.no_grad():
            net.weight.fill_(fill)
        return elastic.TorchState(net, epoch=0, batch=0)

    first = state(1.0)
    first.epoch, first.batch = 7, 3
    with torch.no_grad():
        first.model.weight.fill_(5.0)
    first.commit()
    del first
    gc.collect()

    second = state(2.0)  # the same pieces and directory, the first one gone
    second.sync()
    assert (second.epoch, second.batch, second.commits) == (0, 0, 0) and second.restored_from is None
    assert torch.equal(second.model.weight, torch.full((2, 2), 2.0))
    assert not second.restore() and second.epoch == 0
    second.epoch = 1
    second.commit()  # its own commits stay its own
    assert second.restore() and second.epoch == 1

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted process: the first state again
    again = state(3.0)
    assert again.restore() and (again.epoch, again.batch, again.commits) == (7, 3, 1)
    assert torch.equal(again.model.weight, torch.full((2, 2), 5.0))


EXIT_RUNS = int(os.environ.get("PHALANX_TEST_EXIT_RUNS", "1"))
# Every Python thread still alive once every exit hook but this one has run (a sitecustomize registers it
# first, so it runs last): a phalanx thread there is what ended in SIGABRT about one run in five. And whether
# the objects were frozen for the teardown (gc.freeze: a quicker exit, which the phalanx command does). Each
# rank also writes a line to a file its script never closes, held by an object that refers to itself, as a
# user's own logger can be: only the teardown's last collection flushes it, which a freeze would skip.
THREADS_AT_EXIT = """import atexit, gc, os, sys, threading
class _Held:
    def __init__(self, path):
        self.file, self.me = open(path, "w"), self
if sys.argv and sys.argv[0].endswith("pytorch_mnist_elastic.py"):
    _held = _Held(os.path.join(os.environ["HELD_DIR"], f"held.{os.getpid()}"))
    _held.file.write("written, never flushed or closed by the script\\n")
def _report():
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    print("THREADS-AT-EXIT", alive, flush=True)
    print("FROZEN-AT-EXIT", "worker" if "_held" in globals() else "launcher", gc.get_freeze_count() > 0, flush=True)
atexit.register(_report)
"""


@pytest.mark.timeout(150 * EXIT_RUNS)  # measured: 16-24 s a run on the 2-core machine, 75 s under a load of 20
def test_horovods_elastic_mnist_example_leaves_no_thread_at_exit_and_never_aborts(tmp_path):
    """Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py (only its import changed) under
    `phalanx run -np 2 --min-np 1 --max-np 2`, EXIT_RUNS times on a tiny local MNIST (one step per rank).
    Before issue 39's fix about one run in five aborted after its loop ("terminate called without an
    active exception": the lost-worker watcher thread, still in a store call when the interpreter
    finalized, was ended through torch's noexcept GIL re-acquire; 4 of 20 runs), and the launcher
    counted it as finished after one warning line. The cause is checked on every run, not left to
    chance: no thread may be alive in any process once the exit hooks have run (the old code left
    'phalanx-elastic-lost' there in every run). PHALANX_TEST_EXIT_RUNS=20 repeats it more."""
    import importlib.util
    import time

    jobs = Path(__file__).resolve().parent.parent / "jobs" / "horovod_torch"
    sys.path.insert(0, str(jobs))
    try:
        from mnist_data import write_mnist
    finally:
        sys.path.remove(str(jobs))
    data = write_mnist(str(tmp_path / "data"), n_train=64, n_test=32)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    path = [str(site), str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    if importlib.util.find_spec("torchvision") is None:
        path.insert(1, str(jobs / "standin"))
    held_dir = tmp_path / "held"
    held_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore",
           "HELD_DIR": str(held_dir)}
    began, failures = time.monotonic(), []
    for run in range(EXIT_RUNS):
        env["PHALANX_ELASTIC_DIR"] = str(tmp_path / f"commits{run}")
        proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "1", "--max-np", "2",
                               sys.executable, str(jobs / "pytorch_mnist_elastic.py"), "--epochs", "1",
                               "--batch-size", "32", "--test-batch-size", "32", "--data-dir", data],
                              capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Test set: Average loss" in out, f"run {run}: status {proc.returncode}\n{out[-4000:]}"
        reports = [line for line in out.splitlines() if "THREADS-AT-EXIT" in line]
        assert len(reports) == 3, f"run {run}: want the launcher's and both ranks' thread lists\n{out[-4000:]}"
        failures += [f"run {run}: {line}" for line in reports if not line.endswith("THREADS-AT-EXIT []")]
        frozen = sorted(line[line.index("FROZEN-AT-EXIT"):] for line in out.splitlines() if "FROZEN-AT-EXIT" in line)
        if frozen != ["FROZEN-AT-EXIT launcher True"] + ["FROZEN-AT-EXIT worker False"] * 2:
            failures.append(f"run {run}: want the launcher's objects frozen for its teardown (quicker) and the "
                            f"workers' not (their scripts' files in cycles are flushed there): {frozen}")
        held = sorted(held_dir.glob("held.*"))
        lines = [p.read_text() for p in held]
        if len(held) != 2 or lines != ["written, never flushed or closed by the script\n"] * 2:
            failures.append(f"run {run}: a rank's unclosed file in a cycle lost its line at exit: {lines}")
        for p in held:
            p.unlink()
        if "terminate called" in out or "aborted in the interpreter's teardown" in out:
            failures.append(f"run {run}: " + "; ".join(line for line in out.splitlines()
                                                          if "terminate called" in line or "aborted" in line))
        print(f"run {run}: {time.monotonic() - began:.0f}s, {len(failures)} failures so far", flush=True)
    assert not failures, "\n".join(failures)
