"""Elastic membership changes through `phalanx run` as a subprocess, in the shape of Horovod's elastic
integration tests (tests/jobs/elastic_job.py JOB): a discovery script whose output rank 0 changes at the end
of an epoch, failures scheduled on the workers of a host, both elastic APIs with gradients through
hvd.DistributedOptimizer / px.DataParallel. Checked: the world size of each epoch, the parameters
equal on every rank at the end, the exit status and the launcher's messages."""

import json
import os
import subprocess
import sys
import time

import elastic_job
import pytest
import torch

pytestmark = pytest.mark.ranks


def _run(tmp_path, api, hosts, *flags, exits=None, epochs=3, batches=3, timeout=240, change_wait=None, size=None):
    """Run JOB under `phalanx run FLAGS` (with a discovery script printing hosts[epoch] when hosts is a
    dict); return (proc, log rows, report)."""
    (tmp_path / "job.py").write_text(elastic_job.JOB)
    args = {"epochs": epochs, "batches": batches, "api": api, "exits": exits or {}, "hosts": {}}
    if change_wait:
        args["change_wait"] = change_wait
    if size:
        args["size"] = size  # rank 0 waits at the end of an epoch for the launcher to admit up to this
    if hosts is not None:
        (tmp_path / "hosts.txt").write_text(hosts[0])
        disc = tmp_path / "discover.sh"
        disc.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
        disc.chmod(0o755)
        args["hosts"] = {str(k): v for k, v in hosts.items()}
        flags = (*flags, "--host-discovery-script", str(disc), "--discovery-interval", "0.2")
    cmd = [sys.executable, "-m", "phalanx", "run", *flags, "--timeout", "30", "python", str(tmp_path / "job.py"),
           str(tmp_path), json.dumps(args)]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.ended = time.time()
    proc.took = proc.ended - started
    log = tmp_path / "log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}\nlog:\n" + "\n".join(
        f"{r['what']} {r['wid']}@{r['host']} rank {r['rank']}/{r['size']} gen {r['gen']} e{r.get('epoch')}"
        f" b{r.get('batch')}" for r in rows)
    return proc, rows, report


def _sizes_per_epoch(rows):
    return [r["size"] for r in rows if r["what"] == "epoch"]


def _equal_params(tmp_path, n, report):
    params = [torch.load(tmp_path / f"params.{r}.pt", weights_only=True) for r in range(n)]
    for other in params[1:]:
        for a, b in zip(params[0], other):
            assert torch.equal(a, b), report  # bitwise: every replica the same
    assert all(torch.isfinite(p).all() for p in params[0]), report


def _ended(rows):
    return sorted(r["wid"] for r in rows if r["what"] == "end")


def test_grow_2_to_4_then_shrink_to_2_with_distributed_optimizer(tmp_path):
    # the issue's crash: old ranks' learned bucket layout vs a newcomer's fresh one ("Received data
    # size doesn't match expected size"), then a hang; every rank now re-derives its engine at the re-form.
    # localhost and 127.0.0.1 are two hosts (Horovod's way of testing several hosts on one machine).
    proc, rows, report = _run(tmp_path, "hvd", {0: "localhost:2\n", 1: "localhost:2\n127.0.0.1:2\n",
                                                2: "localhost:2\n"}, "-np", "2", "--min-np", "2", "--max-np", "4")
    assert proc.returncode == 0, report
    assert _sizes_per_epoch(rows) == [2, 4, 2], report  # the world size each epoch, as the script wrote it
    grown = [r for r in rows if r["what"] == "start" and r["size"] == 4]
    assert sorted(r["host"] for r in grown) == ["127.0.0.1", "127.0.0.1", "localhost", "localhost"], report
    assert _ended(rows) == ["w0", "w1"] and "leaves this worker (w2) out" in proc.stderr, report
    _equal_params(tmp_path, 2, report)
    resets = [r["resets"] for r in rows if r["what"] == "end"]  # register_reset_callbacks ran at both resets
    assert resets == [2, 2], report


def test_failed_host_is_set_aside_and_the_job_completes_on_the_rest(tmp_path):
    # phalanx.elastic + DataParallel; w2 (on 127.0.0.1) raises at epoch 1: the host is set aside (no
    # --blacklist-cooldown-range: for good), its other worker leaves, the job ends on localhost's two
    logs = tmp_path / "logs"
    proc, rows, report = _run(tmp_path, "px", {0: "localhost:2\n127.0.0.1:2\n"}, "-np", "4", "--min-np", "2",
                              "--output-filename", str(logs), exits={"1,1": ["w2"]})
    assert proc.returncode == 0, report
    # --output-filename: horovodrun's layout, the failed worker's traceback in its own stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1", "rank.2", "rank.3"], report
    assert "scheduled failure at epoch 1" in (logs / "rank.2" / "stderr").read_text(), report
    assert "host 127.0.0.1 set aside for good" in proc.stderr, report
    assert proc.stderr.count("Traceback") == 1, report  # its traceback, shown once
    assert _sizes_per_epoch(rows) == [4, 2, 2] and _ended(rows) == ["w0", "w1"], report
    assert {r["host"] for r in rows if r["what"] == "start" and r["gen"] > 0} == {"localhost"}, report
    _equal_params(tmp_path, 2, report)


def test_failures_while_a_replacement_is_admitted_complete_with_new_identities(tmp_path):
    # no named hosts: failed workers are replaced on this machine (--max-restarts). w1 raises at epoch 0;
    # at the commit that admits its replacement (w4), while that generation forms, w2 is SIGKILLed: the
    # round is abandoned for the next one, and w2's replacement (w5) is admitted later. The replacements
    # have their own ids and HOROVOD_RANK: neither fails in w1's or w2's place.
    proc, rows, report = _run(tmp_path, "hvd", None, "-np", "4", "--min-np", "2", "--max-restarts", "2",
                              exits={"0,1": ["w1"], "admitting": ["kill:w2"]}, size=4)
    assert proc.returncode == 0, report
    failed = [(r["wid"], r["mode"]) for r in rows if r["what"] == "fail"]
    starts = {r["wid"]: r["start_rank"] for r in rows if r["what"] == "start" and r["wid"] in ("w4", "w5")}
    # Strict order, by the protocol: the launcher admits newcomers only into a generation every member
    # has formed, so the survivors' recovery (3) forms before w4's admission (4) even when a survivor
    # notices w1's loss late (before, under load, the two could merge into one generation).
    assert any(r["what"] == "start" and r["size"] == 3 for r in rows), report
    assert failed == [("w1", "exception"), ("w2", "kill")], report
    assert _ended(rows) == ["w0", "w3", "w4", "w5"] and _sizes_per_epoch(rows)[-1] == 4, report
    # a replacement's HOROVOD_RANK at start is the rank it is to take (3 of 4), not 0 nor a dead worker's
    assert starts == {"w4": "3", "w5": "3"}, report
    _equal_params(tmp_path, 4, report)


def test_every_worker_failing_ends_the_job_naming_the_first_failure(tmp_path):
    proc, rows, report = _run(tmp_path, "hvd", None, "-H", "localhost:2,127.0.0.1:2", "-np", "2",
                              "--min-np", "2", exits={"0,1": ["localhost", "127.0.0.1"]}, timeout=120)
    assert proc.returncode != 0, report
    fails = [r for r in rows if r["what"] == "fail"]
    assert len(fails) == 4 and not [r for r in rows if r["what"] == "end"], report  # -H: the 4 slots offered
    # (all of a generation lost, or too few left: either way it stops and names the first failure)
    assert "stopping the job (" in proc.stderr and "first failure: rank " in proc.stderr, report
    assert proc.stderr.count("Traceback") == 4, report  # each worker's own, once; the launcher repeats none
    print(f"\nlast failure to the launcher's exit: {proc.ended - max(r['t'] for r in fails):.1f}s")


def test_reset_limit_stops_the_job_at_the_second_change(tmp_path):
    proc, rows, report = _run(tmp_path, "hvd", {0: "localhost:2\n", 1: "localhost:3\n", 2: "localhost:2\n"},
                              "-np", "2", "--min-np", "2", "--max-np", "4", "--reset-limit", "1", timeout=180)
    assert proc.returncode != 0, report
    assert "the job reached --reset-limit 1: 1 reset(s) done and another is needed" in proc.stderr, report
    assert _sizes_per_epoch(rows)[:2] == [2, 3], report


# ---------------------------------------------------------------- pieces, in this process


def test_set_aside_hosts_cool_down_and_back_off():
    from phalanx.launcher.hosts import SetAside

    now = [0.0]

    class Low:  # uniform(low, high) -> low
        def uniform(self, low, high):
            return low

    aside = SetAside((2.0, 5.0), clock=lambda: now[0], rng=Low())
    assert aside.add("b") == 2.0 and aside.usable({"a": 2, "b": 2}) == {"a": 2}
    assert aside.any_returns() and aside.returning() == []
    now[0] = 2.0
    assert aside.returning() == ["b"] and aside.usable({"a": 2, "b": 2}) == {"a": 2, "b": 2}
    assert aside.add("b") == 4.0 and aside.add("b") == 5.0  # doubled at each failure, capped at MAX
    forever = SetAside(None)
    assert forever.add("a") == float("inf") and not forever.any_returns()


def test_discovery_listing_no_slots_stops_the_job_after_the_elastic_timeout():
    """A discovery script that lists nothing mid-run (--min-np 1): the members trained on at their size
    for ever (one stays to hand the state to newcomers that never came); now that wait is bounded by
    --elastic-timeout and ends in one line, as a shortage of hosts does. (User tries, stop 50.)"""
    import types

    from phalanx.launcher.supervisor import Supervisor

    sup = Supervisor(["true"], 2, min_np=1, max_np=2, script="/bin/true", elastic_timeout=3.0)
    members = [types.SimpleNamespace(code=None, host="localhost", admitted=True, ready=True, started=0.0)
               for _ in range(2)]
    sup.workers, sup.members, sup.gen, sup.hosts = list(members), list(members), 0, {}
    assert sup._reconcile("host discovery") is None  # within the timeout: the members train on
    sup._short_since -= 4.0
    assert sup._reconcile("host discovery") == ("host discovery lists 0 slot(s), fewer than --min-np 1; the workers "
                                                "trained on at 2 for --elastic-timeout 3s; stopping the job")
    sup._short_since = None
    sup.workers.append(types.SimpleNamespace(code=None, host="b", admitted=False, ready=False, started=1e18))
    sup.hosts = {"b": 2}  # a newcomer starting on another host: wait for it, unbounded by this rule
    assert sup._reconcile("host discovery") is None and sup._short_since is None


def test_discovery_keeps_host_names_and_new_flags_are_checked(tmp_path):
    import argparse

    import pytest

    from phalanx.launcher.discovery import discover_hosts, discover_slots
    from phalanx.launcher.launch_options import add_elastic_arguments, elastic_launch_options

    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\necho node7:4\n")
    script.chmod(0o755)
    assert discover_hosts(str(script)) == {"localhost": 2, "127.0.0.1": 1, "node7": 4}  # two hosts here
    assert discover_slots(str(script)) == 3
    p = argparse.ArgumentParser()
    add_elastic_arguments(p)
    args = p.parse_args(["--reset-limit", "2", "--blacklist-cooldown-range", "1", "5", "--elastic-timeout", "30"])
    assert (args.reset_limit, args.blacklist_cooldown_range, args.elastic_timeout) == (2, [1.0, 5.0], 30.0)
    elastic_launch_options(args, 2, {})
    for bad, message in ((["--reset-limit", "-1"], "--reset-limit must be >= 0"),
                         (["--blacklist-cooldown-range", "5", "1"], "write MIN MAX"),
                         (["--elastic-timeout", "0"], "--elastic-timeout must be positive")):
        with pytest.raises(ValueError, match=message):
            elastic_launch_options(p.parse_args(bad), 2, {})


def _old_rank_and_newcomer():
    import phalanx as px
    from phalanx.parallel.data.gradients import reform_engines

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return net, px.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                            named_parameters=net.named_parameters())

    net, opt = build()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(px.rank()))
    for _ in range(2):  # the buckets are re-planned from rank 0's order and no longer mismatch-checked
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    learned = opt._engine.buckets.rebuilt
    if px.rank() == 1:  # a newcomer: a fresh model and optimizer, rank 0's state by broadcast
        net, opt = build()
    reformed = reform_engines(px.topology())  # on every rank after a re-form (phalanx.elastic.run does)
    fresh = opt._engine.buckets.rebuilt
    px.broadcast_parameters(net.state_dict(), root_rank=0)
    for _ in range(2):  # the same collectives on both ranks now (before: a mismatch, then a hang)
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    return {"learned": learned, "fresh": fresh, "reformed": reformed, "world": opt._engine.world,
            "params": [p.detach().clone() for p in net.parameters()]}


def test_engines_start_over_at_a_reform_so_old_ranks_and_newcomers_match():
    from phalanx.testing import distributed

    out = distributed(_old_rank_and_newcomer, np=2, timeout=120)
    assert [o["learned"] for o in out] == [True, True] and [o["fresh"] for o in out] == [False, False]
    assert out[0]["reformed"] >= 1 and out[1]["reformed"] >= 2 and {o["world"] for o in out} == {2}
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)


def test_a_frozen_worker_is_a_lost_worker_and_the_survivors_go_on(tmp_path):
    # issue 27: w1 stops (SIGSTOP: a rank stuck in a driver call or a swapped-out host looks so). Its
    # heartbeat stops with it; after --heartbeat-timeout (3 s) of silence in process state T the supervisor
    # kills it through its own handle, and
    # the survivor re-forms in-process as for a kill (before: the collective --timeout, then 50 s of a
    # re-form that could not happen while the frozen process lived, then a group restart).
    proc, rows, report = _run(tmp_path, "px", None, "-np", "2", "--min-np", "1", "--max-np", "2",
                              exits={"0,1": ["stop:w1"]}, size=2)
    assert proc.returncode == 0, report
    assert [(r["wid"], r["mode"]) for r in rows if r["what"] == "fail"] == [("w1", "stop")], report
    assert "worker w1 stopped responding" in proc.stderr and "process state T (stopped)" in proc.stderr, report
    assert "a stalled worker is a lost worker" in proc.stderr and "group restart" not in proc.stderr, report
    assert "w1" not in _ended(rows) and _sizes_per_epoch(rows)[-1] == 2, report  # its replacement took its slot
    _equal_params(tmp_path, 2, report)
    froze = next(r["t"] for r in rows if r["what"] == "fail")
    print(f"\nfreeze to the job's end: {proc.ended - froze:.1f}s")
