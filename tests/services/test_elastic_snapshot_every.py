"""TorchState(snapshot_every=N) under in-process elastic: a commit every step keeps the state in memory
and writes its file every N-th commit only. Survivors of a SIGKILL resume from the last commit in memory
(one that wrote no file); a group restart resumes from the last file; both end equal to the one-process
run of the same steps. TorchState(recover="live"): no copy per commit; the survivor goes on from its
live state (no step lost), a replacement joins at a commit with the current state, rank 0's snapshots
load; the replacement's group is formed in the background while the survivors train (admission
without a pause). Real ranks through `phalanx run --min-np/--max-np`."""

import os
import subprocess
import sys
import textwrap

import elastic_job
import pytest
import torch

from phalanx import elastic

pytestmark = pytest.mark.cluster

TOTAL, G, N_DATA, KILL_AT, EVERY = 16, 12, 64, 8, 3

WORKER = textwrap.dedent(f"""
    import os, signal, sys, time, zlib
    import torch
    import phalanx as px
    from phalanx import elastic
    from phalanx.elastic import inprocess

    TOTAL, G, N_DATA, KILL_AT, EVERY = {TOTAL}, {G}, {N_DATA}, {KILL_AT}, {EVERY}
    RECOVER = os.environ.get("TEST_RECOVER", "commit")
    NP = int(os.environ.get("TEST_NP", "2"))

""") + elastic_job.HELPERS + textwrap.dedent("""

    def main(out):
        px.init()
        x, y = data()
        model, opt = make()
        state = elastic.TorchState(model, opt, sampler=elastic.ElasticSampler(N_DATA, seed=1), step=0,
                                   commit_dir=os.path.join(out, "commits"), keep=100, snapshot_every=EVERY,
                                   recover=RECOVER)

        def event(what, **extra):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{what} step={state.step} rank={px.rank()} size={px.size()} pid={os.getpid()} "
                        f"gen={inprocess.generation()} restart={elastic.restart_count()} "
                        f"copy={int(state._memory is not None)}"
                        + "".join(f" {k}={v}" for k, v in extra.items()) + "\\n")

        @elastic.run
        def train(state):
            event("start")
            while state.step < TOTAL:
                if RECOVER == "live" and px.size() < NP and state.step >= KILL_AT + 2:
                    if inprocess.admitting() is not None:
                        event("forming")   # committing while the replacement's group forms in the background
                    time.sleep(0.05)   # the survivors wait (committing) for the replacement to join
                    state.commit()
                    continue
                step(model, opt, state.sampler, x, y, px.size())
                state.step += 1
                first = not os.path.exists(os.path.join(out, "killed"))   # (a group restart counts from 0 again)
                if first and state.step == KILL_AT and px.rank() == NP - 1:
                    open(os.path.join(out, "killed"), "w").close()
                    event("kill")
                    os.kill(os.getpid(), signal.SIGKILL)
                state.commit()   # every step

        train(state)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        event("end", crc=zlib.crc32(flat.numpy().tobytes()))   # every rank's parameters, bit for bit
        if px.rank() == 0:
            torch.save([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))

    if __name__ == "__main__":
        main(sys.argv[1])
""")


def _events(path):
    return [{"what": line.split()[0], **{k: int(v) for k, v in (x.split("=") for x in line.split()[1:])}}
            for line in path.read_text().splitlines()]


def _run(tmp_path, flags, env=None, np=2):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(np), *flags, "--timeout", "60",
           sys.executable, str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TEST_NP": str(np), **(env or {})})
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for got, want in zip(final, elastic_job.reference(WORKER, TOTAL, N_DATA)[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    (tmp_path / "stderr.txt").write_text(proc.stderr)
    return _events(tmp_path / "events.txt"), report


def test_survivor_resumes_from_a_commit_in_memory_that_wrote_no_file(tmp_path):
    ev, report = _run(tmp_path, ["--min-np", "1", "--max-np", "2", "--max-restarts", "0"])
    kill = [e for e in ev if e["what"] == "kill"]
    after = [e for e in ev if e["what"] == "start" and e["gen"] == 1]
    assert len(kill) == 1 and len(after) == 1 and after[0]["size"] == 1, report
    # the last commit before the kill (the step before, or the killed step's own on the survivor, which
    # keeps it in memory before the commit's collective finds the peer gone): neither wrote a file
    assert after[0]["step"] in (KILL_AT - 1, KILL_AT) and after[0]["step"] % EVERY != 0, (after, report)
    assert after[0]["restart"] == 0, report   # the same process: no group restart
    files = sorted(os.listdir(tmp_path / "commits"))
    assert files and all(int(f.split("-")[1]) % EVERY == 0 for f in files), files


def test_live_recovery_loses_no_step_and_a_replacement_joins_with_the_current_state(tmp_path):
    # recover="live", 3 workers: the killed rank dies after its step KILL_AT (its allreduces done), so the
    # survivors applied that step too: they go on from KILL_AT itself, with no copy of the state ever made.
    # The launcher's replacement (--max-restarts 1) is admitted without a pause: the survivors' vote at a
    # commit says a generation adds it, they check in and connect its group in the background while they
    # go on committing, and switch to it at a later commit, where rank 0 sends it the state in sync() and
    # the other survivor goes on at once (phalanx.elastic.handover). The
    # final parameters equal the one-process run's (a step lost, half applied or applied twice would not)
    # PHALANX_ELASTIC_SPARE: the replacement is the launcher's warm spare, its imports done ahead, which runs
    # the script in its own interpreter (phalanx.launcher.spare): the same checks hold for it
    ev, report = _run(tmp_path, ["--min-np", "1", "--max-np", "3", "--max-restarts", "1"],
                      {"TEST_RECOVER": "live", "PHALANX_ELASTIC_SPARE": "1"}, np=3)
    assert "started worker w3 on localhost (the warm spare)" in report, report
    starts = [e for e in ev if e["what"] == "start"]
    kill = [e for e in ev if e["what"] == "kill"]
    assert len(kill) == 1 and kill[0]["step"] == KILL_AT, report
    survivors = [e for e in starts if e["gen"] == 1]
    assert len(survivors) == 2 and {e["size"] for e in survivors} == {2}, (starts, report)
    assert {e["step"] for e in survivors} == {KILL_AT} and {e["restart"] for e in survivors} == {0}, (starts, report)
    joined = [e for e in starts if e["gen"] >= 2 and e["size"] == 3]
    assert len(joined) == 3 and len({e["step"] for e in joined}) == 1 and joined[0]["step"] > KILL_AT, (starts, report)
    newcomer = [e for e in joined if e["pid"] not in {s["pid"] for s in starts[:3]}]
    assert len(newcomer) == 1, (starts, report)
    # admission without a pause: each survivor committed while the group formed, then switched to it
    forming = {e["pid"] for e in ev if e["what"] == "forming"}
    assert forming == {e["pid"] for e in survivors}, (ev, report)
    assert (tmp_path / "stderr.txt").read_text().count("formed in the background") == 2, report
    assert all(e["copy"] == 0 for e in ev), (ev, report)   # no commit ever copied the state
    ends = [e for e in ev if e["what"] == "end"]
    assert len(ends) == 3 and {e["size"] for e in ends} == {3}, (ev, report)
    # the newcomer's state came from rank 0 alone, sent while the members trained on (phalanx.elastic.handover),
    # and every rank ends with the same parameters, bit for bit
    assert (tmp_path / "stderr.txt").read_text().count("state handed to newcomer rank(s) 2 ") == 1, report
    assert len({e["crc"] for e in ends}) == 1, (ends, report)
    # rank 0 wrote the snapshots alone, every EVERY-th commit, and one loads in a single process
    files = sorted(f for f in os.listdir(tmp_path / "commits") if f.endswith(".pt"))
    numbers = [int(f[len("commit-"):-len(".pt")]) for f in files]
    assert numbers and all(n % EVERY == 0 for n in numbers), files
    ns = {}
    exec(compile(WORKER.split("\ndef main")[0], "worker", "exec"), ns)
    model, opt = ns["make"]()
    state = elastic.TorchState(model, opt, step=0, commit_dir=str(tmp_path / "commits"), recover="live")
    assert state.restore() and state.commits == numbers[-1] and 0 < state.step <= TOTAL, files


def test_group_restart_resumes_from_the_last_snapshot(tmp_path):
    # --min-np 2 and a 1 s re-form wait: the survivor gives up and the whole group restarts from the
    # newest file, the commit of step 6 (commit 6: every EVERY-th commit is written)
    env = {"PHALANX_ELASTIC_REFORM_TIMEOUT": "1"}
    ev, report = _run(tmp_path, ["--min-np", "2", "--max-restarts", "1"], env)
    assert "recovery path: group restart on TorchElastic" in report, report
    restarted = [e for e in ev if e["what"] == "start"][2:]
    assert len(restarted) == 2 and not {e["pid"] for e in restarted} & {e["pid"] for e in ev[:2]}, (ev, report)
    assert {e["step"] for e in restarted} == {(KILL_AT - 1) // EVERY * EVERY}, (restarted, report)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_snapshot_every_must_be_a_whole_number_of_commits(bad):
    with pytest.raises(ValueError, match=r"TorchState\(snapshot_every=.*\): give a whole number of commits >= 1"):
        elastic.TorchState(torch.nn.Linear(1, 1), snapshot_every=bad)


@pytest.mark.unit
def test_recover_takes_commit_or_live():
    with pytest.raises(ValueError, match=r"TorchState\(recover='copy'\): give 'commit' .* or 'live'"):
        elastic.TorchState(torch.nn.Linear(1, 1), recover="copy")


@pytest.mark.unit
def test_live_votes_are_spaced_about_one_vote_period_apart(monkeypatch):
    # rank 0 proposes, at each vote, the commits every member skips before the next: its commits per
    # pending.VOTE_S (VOTE_BUSY_S while a change is pending or an admission forms) less one, timed commit
    # by commit since its last vote (a pause between commits counted as 4 commits), at most 2n+1 after n
    from phalanx.elastic import pending

    monkeypatch.setattr(pending, "VOTE_S", 0.5)
    monkeypatch.setattr(pending, "VOTE_BUSY_S", 0.05)
    now, left = [0.0], [0]
    monkeypatch.setattr(pending.time, "monotonic", lambda: now[0])
    poll = pending.PendingPoll("127.0.0.1:1", lambda: 0)   # (not started: no thread, no store)

    def commits(n: int, apart: float, *, busy: bool = False, pause: float = 0.0) -> list[int]:
        """n commits, each ``apart`` seconds after the one before (the first ``pause`` more): the counts
        proposed at the votes among them."""
        proposed = []
        now[0] += pause
        for _ in range(n):
            now[0] += apart
            poll.tick()
            if left[0]:
                left[0] -= 1
            else:
                left[0] = poll.commits_to_skip(busy=busy)
                proposed.append(left[0])
        return proposed

    # 16 ms a commit: a vote every 31st commit (0.5 s), reached by at most doubling (the first vote
    # measured nothing yet)
    assert commits(62, 0.016) == [0, 1, 3, 7, 15, 30]
    # a 1 s pause before the next commit (an evaluation, steps that commit nothing) is not slow commits:
    # 30 x 16 ms + 4 x 16 ms over 31 commits, a vote every 28th (timed whole: every 10th, so the votes
    # crowded into the commits after each pause)
    assert commits(28, 0.016, pause=1.0) == [27]
    assert commits(31, 0.016) == [30]
    assert commits(3, 0.016, busy=True) == [2]   # busy: every 3rd commit (48 ms)
    # commits slowed to 0.5 s: the first long gap is taken for a pause (the count still at most doubles),
    # then most gaps since the vote are long, so they are timed as they are: every commit votes
    assert commits(8, 0.5) == [5, 0, 0]
    assert commits(1, 1e-6) == [1]   # a commit in a microsecond: the count doubles, no more
    poll.forget_rate()   # a re-form: the count proposed was dropped, so no rate from it
    left[0] = 0
    assert commits(1, 1e-6) == [0]
    # commits far shorter than a vote's period: doubling up to the cap
    assert commits(255, 1e-6)[:7] == [1, 3, 7, 15, 31, 63, pending._MAX_SKIP]


@pytest.mark.unit
def test_a_snapshot_file_holds_a_copy_of_every_piece(tmp_path):
    # rank 0's snapshot packs every tensor into one buffer per dtype: what loads back must be each
    # tensor as it was at the commit (not as training changed it after), every other value too, and a
    # state dict's version metadata (load_state_dict reads it)
    from phalanx.elastic.snapshots import Snapshots

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model(torch.randn(4, 3))
    # an optimizer's state dict, by hand (torch.optim imports dynamo: seconds under load)
    optimizer = {"state": {0: {"momentum_buffer": torch.randn(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    tree = {"model": model.state_dict(), "optimizer": optimizer, "step": 7, "name": "x",
            "extra": (torch.arange(5, dtype=torch.int64)[::2], [torch.ones(2, dtype=torch.bfloat16), None])}
    want = {k: v.clone() for k, v in model.state_dict().items()}
    files = Snapshots(str(tmp_path), keep=1)
    files.write(3, tree)
    with torch.no_grad():  # training goes on while the file is written
        for p in model.parameters():
            p.add_(1.0)
    number, back = files.latest()
    assert number == 3 and back["step"] == 7 and back["name"] == "x"
    assert all(torch.equal(back["model"][k], want[k]) for k in want), (back["model"], want)
    assert back["model"]._metadata == model.state_dict()._metadata
    assert torch.equal(back["optimizer"]["state"][0]["momentum_buffer"], optimizer["state"][0]["momentum_buffer"])
    assert back["optimizer"]["param_groups"] == optimizer["param_groups"]
    assert torch.equal(back["extra"][0], torch.tensor([0, 2, 4])) and back["extra"][1][1] is None
    assert back["extra"][1][0].dtype == torch.bfloat16 and torch.equal(back["extra"][1][0].float(), torch.ones(2))
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(back["model"])
    files.write(4, {"model": model.state_dict(), "step": 8}, background=False)
    assert sorted(os.listdir(tmp_path)) == ["commit-000000004.pt"]   # keep=1 pruned the older one
    assert torch.equal(files.latest()[1]["model"]["0.bias"], model.state_dict()["0.bias"])


@pytest.mark.unit
def test_snapshot_period_spaces_rank_0s_snapshots_in_time(tmp_path, monkeypatch):
    # recover="live", one process (every commit due): with snapshot_period_s, a snapshot only at the first
    # commit at least that long after the last one; what loads back is that commit's state
    from phalanx.elastic import state as state_module

    clock = iter([0.0, 0.4, 0.9, 1.0, 1.5, 2.2])   # the times of the commits that are due
    monkeypatch.setattr(state_module, "_clock", lambda: next(clock))
    weight = torch.nn.Parameter(torch.zeros(2))
    state = elastic.TorchState(weight=weight, commit_dir=str(tmp_path / "c"), keep=100, recover="live",
                               snapshot_period_s=1.0, step=0)
    for step in range(1, 7):
        with torch.no_grad():
            weight.fill_(step)
        state.step = step
        state.commit()
    state.finish()
    assert sorted(os.listdir(tmp_path / "c")) == [f"commit-{n:09d}.pt" for n in (1, 4, 6)]
    from phalanx.elastic.snapshots import Snapshots

    number, tree = Snapshots(str(tmp_path / "c")).latest()
    assert number == 6 and tree["pieces"]["step"] == 6, tree
    assert torch.equal(tree["pieces"]["weight"], torch.full((2,), 6.0)), tree


@pytest.mark.unit
def test_live_snapshots_default_to_one_per_period_and_zero_gives_every_due_commit(tmp_path, monkeypatch):
    # recover="live" without snapshot_period_s: rank 0 snapshots at most once per state.LIVE_SNAPSHOT_S
    # (the survivors never read the file; it serves a whole-group restart); 0: every due commit
    from phalanx.elastic import state as state_module

    period = state_module.LIVE_SNAPSHOT_S
    clock = iter([0.0, period / 2, period - 0.01, period, period * 1.5, period * 2.5])
    monkeypatch.setattr(state_module, "_clock", lambda: next(clock))
    weight = torch.nn.Parameter(torch.zeros(2))
    default = elastic.TorchState(weight=weight, commit_dir=str(tmp_path / "d"), keep=100, recover="live", step=0)
    every = elastic.TorchState(weight=weight, commit_dir=str(tmp_path / "e"), keep=100, recover="live",
                               snapshot_period_s=0, step=0)
    for step in range(1, 7):
        default.step = every.step = step
        default.commit()
        every.commit()   # (reads no clock: the iterator above would run out)
    default.finish()
    every.finish()
    assert sorted(os.listdir(tmp_path / "d")) == [f"commit-{n:09d}.pt" for n in (1, 4, 6)]
    assert sorted(os.listdir(tmp_path / "e")) == [f"commit-{n:09d}.pt" for n in range(1, 7)]


@pytest.mark.unit
@pytest.mark.parametrize("recover, period", [("live", -1.0), ("live", "2s"), ("commit", 2.0)])
def test_snapshot_period_needs_seconds_and_live_recovery(recover, period):
    with pytest.raises(ValueError, match=r"TorchState\(snapshot_period_s=.*\): give a number of seconds >= 0 "
                                         r"with recover='live'"):
        elastic.TorchState(torch.nn.Linear(1, 1), recover=recover, snapshot_period_s=period)


@pytest.mark.unit
def test_a_snapshot_file_cut_short_or_foreign_is_refused_in_one_line(tmp_path):
    from phalanx.elastic.snapshots import Snapshots

    files = Snapshots(str(tmp_path), keep=2)
    path = files.write(1, {"w": torch.ones(1000)}, background=False)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match="is cut short"):
        files.latest()
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 a torch.save zip")
    with pytest.raises(ValueError, match="is not an elastic snapshot"):
        files.latest()
