"""The launcher side of in-process elastic training: start the workers, host the store, never restart survivors.

``phalanx run --min-np A --max-np B`` (and ``-H``/``--host-discovery-script``) runs this instead of TorchElastic's agent,
whose worker group is all-or-nothing. Each worker is a process of its own, here or over SSH (``python -m phalanx.launcher.agent
worker``), or the Popen-like handle ``starter(wid, host, env)`` returns (phalanx.ray's actors; ``script`` a function giving
the slots); hosts are the names the host list or discovery gives (``localhost`` and ``127.0.0.1`` are two hosts)::

    start: store ─ gen 0 = w0..w{n-1} (the slots offered, up to --max-np) ─ workers px.init() on it
    worker w2 exits non-zero ─ "rank 2 (w2 on h) failed: killed by SIGKILL" ─ with named hosts (-H,
        discovery) host h is set aside (--blacklist-cooldown-range: for a while, else for good);
        without, a replacement starts here (--max-restarts in all) ─ publish gen 1 = survivors
        (their collectives raise; they re-form in-process: phalanx.elastic.inprocess)
    new slots (discovery, a cooldown over) ─ start joiners there ─ post a host-change notice (host_notices.py)
    joiners ready (all started together) ─ publish gen = members + them ─ re-form at the next commit
    discovery lists fewer slots ─ publish a gen without the surplus ─ they leave at the next commit
    each new generation is a reset: --reset-limit N stops the job at the N+1-th, naming the limit
    fewer than --min-np can run ─ wait for hosts to return (cooldown, discovery) up to --elastic-timeout,
        or stop at once when none can ─ exit 1 naming the first failure
    a worker could not re-form (exit 75) ─ TorchElastic group restart from the last snapshot (fallback)
    every member exited 0 ─ done (workers still waiting to join are told to exit 0)

Example::

    code = Supervisor(["python", "train.py"], np=4, min_np=2, max_np=4).run()
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import uuid

from phalanx.elastic import inprocess, lost
from phalanx.launcher import handoff
from phalanx.launcher import secret as job_secret
from phalanx.launcher.discovery import discover_reachable
from phalanx.launcher.elastic_signals import PREEMPTED_EXIT_CODE, ElasticPreemption
from phalanx.launcher.host_notices import ADDED, HostNotices
from phalanx.launcher.hosts import SetAside, is_local, route_source
from phalanx.launcher.spare import Spare
from phalanx.launcher.stall import ElasticStalls, describe_exit, ended_then_aborted
from phalanx.launcher.worker_env import PER_RANK_VARS, worker_env
from phalanx.launcher.worker_output import WorkerOutput, stop_processes
from phalanx.log import get_logger
from phalanx.settings import ElasticSettings

__all__ = ["Supervisor"]

log = get_logger(__name__)
_EXEC_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exec.py")
_GRACE_S = 10.0
_LOCAL = "localhost"


class _Worker:
    def __init__(self, wid: str, host: str, proc: subprocess.Popen, joiner: bool) -> None:
        self.wid, self.host, self.proc, self.joiner = wid, host, proc, joiner
        self.spare = False  # started as the warm spare (phalanx.launcher.spare)
        self.code: int | None = None
        self.admitted = self.ready = not joiner  # admitted: in a published generation
        self.started = time.monotonic()


class Supervisor:
    """Run ``command`` as an in-process elastic job; :meth:`run` returns the exit code."""

    def __init__(self, command: list[str], np: int, *, min_np: int | None = None, max_np: int | None = None,
                 env: dict[str, str] | None = None, script: str | None = None, interval_s: float = 1.0,
                 max_restarts: int = 3, ssh=None, network_interface: str | None = None,
                 start_timeout: int = 60, run_id: str | None = None, fallback=None,
                 ranks_filter: frozenset[int] | None = None, hosts: dict[str, int] | None = None,
                 reset_limit: int | None = None, cooldown: tuple[float, float] | None = None,
                 elastic_timeout: float = 600.0, log_dir: str | None = None,
                 stall_timeout: float | None = None, starter=None, store_addr: str | None = None,
                 replace_failed: bool = False, heartbeat_timeout: float | None = None) -> None:
        self.command, self.np = list(command), np
        self.named_hosts = dict(hosts) if hosts else None  # -H / --hostfile: Horovod's host semantics
        offered = sum(self.named_hosts.values()) if self.named_hosts else np
        self.min_np, self.max_np = min_np or 1, max(max_np or max(offered, np), np)
        # Horovod's driver: with hosts named (-H, a discovery script) a host whose worker failed is
        # set aside; without, this machine is the job and a failed worker is replaced (--max-restarts)
        # (slots from a function, SLURM nodes: replaced)
        self.horovod_hosts = (bool(hosts) or isinstance(script, str)) and not replace_failed
        self.aside, self.starter = SetAside(cooldown), starter
        self.store_addr = store_addr  # where workers reach the store (None: our route to the first remote host)
        self.reset_limit, self.resets = reset_limit, 0
        self.elastic_timeout, self.stall_timeout = elastic_timeout, stall_timeout
        # a worker silent this long is lost; it beats six times in that span (at most once a second)
        self.heartbeat_timeout = heartbeat_timeout or ElasticSettings.one("heartbeat_timeout_s")
        self.first_failure: str | None = None
        self._short_since: float | None = None  # since when fewer than --min-np workers can run
        self.env, self.script, self.interval_s = dict(env or {}), script, interval_s
        self.replacements_left = max_restarts
        self.ssh, self.network_interface, self.start_timeout = ssh, network_interface, start_timeout
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.fallback = fallback  # callable(np, restarts_left) -> exit code: the TorchElastic restart path
        self.workers: list[_Worker] = []
        self.members: list[_Worker] = []  # of the latest published generation, in rank order
        self.gen = -1
        self.sizes: list[tuple[float, int]] = []  # (time, size) of each generation published, in order
        self.hosts: dict[str, int] = {}
        self.wanted = np
        self._lock = threading.Lock()
        self._next_wid = 0
        # ranks_filter: whose output is shown (None: all; joiners always); log_dir: --output-filename
        self.output = WorkerOutput(self._rank_of, log_dir=log_dir, ranks_filter=ranks_filter)
        self._secret: bytes | None = None
        self._probed: set[str] = set()
        self._warned: set[str] = set()  # discovery failures already said
        self.spare = Spare(self.command) if ElasticSettings.one("spare", {**os.environ, **self.env}) else None

    # -- hosts ------------------------------------------------------------------
    def _discover(self) -> dict[str, int] | None:
        return discover_reachable(self.script, self._probed, self.ssh, timeout_s=max(self.interval_s, 5.0),
                                  warned=self._warned)

    def _clamp(self, total: int) -> int:
        return max(self.min_np, min(self.max_np, total))

    def _usable(self) -> dict[str, int]:
        """The hosts' slots, less the hosts set aside (cooldowns that ended bring theirs back)."""
        for h in self.aside.returning():
            print(f"phalanx: host {h} is back after its cooldown (--blacklist-cooldown-range)", flush=True)
        return self.aside.usable(self.hosts)

    def _wanted(self) -> int:
        return min(self.max_np, sum(self._usable().values()))

    # -- workers ----------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        return worker_env(self.env, self.run_id, self.addr, self.store.port, self.wanted, self.heartbeat_timeout)

    def _start(self, host: str, rank_env: dict[str, int] | None, expected_rank: int = 0) -> _Worker:
        wid = f"w{self._next_wid}"
        self._next_wid += 1
        env = self._base_env()
        env[inprocess.WID_ENV] = wid
        env["HOROVOD_HOSTNAME"] = host  # the name the host list / discovery gave (Horovod's meaning)
        if rank_env is None:
            env[inprocess.JOIN_ENV] = "1"
            # its own identity before it joins: the rank it is to take, not a dead worker's (nor 0)
            env["HOROVOD_RANK"] = str(expected_rank)
        else:
            env.update({k: str(v) for k, v in rank_env.items()})
            env[inprocess.GEN_ENV] = "0"
        # a replacement here: the warm spare, its imports done, if one is waiting (phalanx.launcher.spare)
        spare = self.spare.take(env) if self.spare and rank_env is None and not self.starter and is_local(host) else None
        if spare is not None:
            proc = spare
        elif self.starter is not None:  # e.g. a Ray actor; its handle's stdout/stderr may be empty
            proc = self.starter(wid, host, env)
        elif is_local(host):
            proc = subprocess.Popen([sys.executable, _EXEC_SHIM, *self.command], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        else:
            proc = self._start_remote(host, {k: v for k, v in env.items() if k.startswith(("PHALANX_", "TORCH",
                                      "MASTER_", "OMP_", "HOROVOD_", "GLOO_", "NCCL_")) or k in PER_RANK_VARS or k == "PYTHONPATH"})
        w = _Worker(wid, host, proc, joiner=rank_env is None)
        w.spare = spare is not None
        self.workers.append(w)
        self.output.attach(w, wid, proc.stdout, proc.stderr, rank_env["RANK"] if rank_env else None)
        return w

    def _start_remote(self, host: str, env: dict[str, str]) -> subprocess.Popen:
        if self._secret is None:
            self._secret = job_secret.new_secret()
        remote = handoff.remote_command("worker", env, self.network_interface, self.command)
        proc = subprocess.Popen(self.ssh.command(host, remote), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        handoff.send_secret(proc, self._secret)  # stdin then stays open: EOF tells the worker to stop
        return proc

    def _rank_of(self, w: _Worker) -> int | None:
        with self._lock:
            return self.members.index(w) if w in self.members else None

    def _alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.code is None]

    def _fill(self, replacing: bool) -> int:
        """Start joiners until the wanted size is reached (the usable hosts' free slots permitting); how many."""
        hosts = self._usable()
        alive = [w for w in self._alive() if w.host in hosts]  # (not those about to leave)
        count = 0
        while len(alive) < self.wanted and (not replacing or self.replacements_left > 0):
            used = {h: sum(1 for w in alive if w.host == h) for h in hosts}
            free = [h for h, slots in hosts.items() if used[h] < slots]
            if not free:
                break
            expected = len([w for w in alive if w.code is None])
            w = self._start(free[0], None, expected)
            if replacing:
                self.replacements_left -= 1
            print(f"phalanx: started worker {w.wid} on {w.host}{' (the warm spare)' if w.spare else ''}; it joins "
                  "at the next commit", flush=True)
            alive.append(w)
            count += 1
        return count

    # -- generations ------------------------------------------------------------
    def _publish(self, members: list[_Worker], why: str) -> str | None:
        """Publish the next generation; an abort reason instead when --reset-limit is reached."""
        if self.gen >= 0 and self.reset_limit is not None:
            if self.resets >= self.reset_limit:
                return (f"the job reached --reset-limit {self.reset_limit}: {self.resets} reset(s) done and "
                        f"another is needed ({why}); stopping")
            self.resets += 1
        with self._lock:
            old, self.gen = self.members, self.gen + 1
            self.members = list(members)
        notice = self.notices.cover([w.wid for w in old], [w.wid for w in members], first=self.gen == 0)
        body = json.dumps({"members": [[w.wid, w.host] for w in members], "notice": notice})
        self.store.set(f"pxe/gen/{self.gen}", body)
        self.store.set("pxe/latest", str(self.gen))
        self.sizes.append((time.time(), len(members)))
        for w in members:
            w.admitted = True
        if self.gen > 0:
            print(f"phalanx: generation {self.gen}: {len(members)} workers ({why})", flush=True)

    def _stop(self, reason: dict) -> None:
        if not self.store.check(["pxe/stop"]):
            self.store.set("pxe/stop", json.dumps(reason))

    def _reconcile(self, why: str) -> str | None:
        """Publish the next generation if the membership should change; returns an abort reason or None."""
        hosts = self._usable()
        self.wanted = self._wanted()
        keep = [w for w in self.members if w.code is None]
        per_host: dict[str, int] = {}
        kept = []
        for w in keep:  # the usable hosts' slots as listed now; the surplus leaves
            per_host[w.host] = per_host.get(w.host, 0) + 1
            if per_host[w.host] <= hosts.get(w.host, 0) and len(kept) < self.wanted:
                kept.append(w)
        ready = [w for w in self.workers if w.code is None and not w.admitted and w.ready
                 and w.host in hosts]
        starting = [w for w in self.workers if w.code is None and not w.ready]
        still = any(time.monotonic() - w.started < self.start_timeout for w in starting)
        if still:
            ready = []  # admit the joiners started together in one generation (one re-form, not several)
        # newcomers enter only a generation every member has formed: a recovery (published at once) forms
        # first and the admission comes at a later commit, however late a survivor notices its loss
        held = ready if ready and self.gen > 0 and self.store.add(f"pxe/g{self.gen}/arrived", 0) < len(
            self.members) else []
        ready = [] if held else ready
        # every host the members ran on set aside for good: stop, as Horovod does (with a cooldown a live
        # member waits below to hand the state over; Horovod stops then too). docs/elastic.md
        ran_on = list(dict.fromkeys(w.host for w in self.members))
        if self.horovod_hosts and ran_on and all(self.aside.until.get(h) == float("inf") for h in ran_on):
            return (f"every host the job's workers ran on ({', '.join(ran_on)}) was set aside after a worker there failed; "
                    "stopping the job" + self._first())
        if not kept and keep:  # the job moves off its hosts: one old member stays to hand the state over
            if not ready:  # (until the newcomers are ready; it leaves at the next change), bounded if none can come
                return None if starting or sum(hosts.values()) >= self.min_np else self._short(
                    f"host discovery lists {sum(hosts.values())} slot(s), fewer than --min-np {self.min_np}; the "
                    f"workers trained on at {len(keep)}")
            kept = keep[:1]
        target = kept + ready[: max(0, self.max_np - len(kept))]
        if not kept and self.members:  # no live member to take the state from: newcomers would start over
            return f"every worker of generation {self.gen} was lost; stopping the job" + self._first()
        if len(target) < self.min_np:
            if len(target) + len(starting) + len(held) >= self.min_np:
                return None  # wait for the replacements to come up (the survivors wait, bounded, to re-form)
            aside = f"; set aside after failures: {', '.join(sorted(self.aside.until))}" if self.aside.until else ""
            short = (f"{len(target)} worker(s) can run, fewer than --min-np {self.min_np} (usable hosts: "
                     f"{', '.join(f'{h}:{n}' for h, n in hosts.items()) or 'none'}{aside})")
            if not (self.aside.any_returns() or self.script):
                return f"{short}, and none starting; stopping the job" + self._first()
            return self._short(short)  # hosts may come back (a cooldown, discovery): wait, bounded
        self._short_since = None
        if target != self.members or (self.notices.pending and not still and not held):
            return self._publish(target, why)  # (a host change announced must end in a generation)
        return None

    def _short(self, short: str) -> str | None:
        """Too few slots: None while --elastic-timeout has not passed since they were first short, then the reason."""
        self._short_since = self._short_since or time.monotonic()
        if time.monotonic() - self._short_since > self.elastic_timeout:
            return f"{short} for --elastic-timeout {self.elastic_timeout:g}s; stopping the job" + self._first()
        return None

    def _first(self) -> str:
        return f" (first failure: {self.first_failure})" if self.first_failure else ""

    # -- the loop ---------------------------------------------------------------
    def run(self) -> int:
        if self.script:
            hosts = self._discover() or {}
            if not hosts:
                print("phalanx: host discovery lists no usable host; using this machine with -np "
                      f"{self.np}", file=sys.stderr, flush=True)
                hosts = {_LOCAL: self.np}
            self.hosts = hosts
            self.wanted = self._clamp(sum(hosts.values()))
        elif self.named_hosts:
            self.hosts = dict(self.named_hosts)
            self.wanted = self._clamp(sum(self.hosts.values()))
        else:
            self.hosts, self.wanted = {_LOCAL: self.np}, self.np
        remote = [h for h in self.hosts if not is_local(h)]
        self.addr = self.store_addr or (route_source(remote[0]) if remote else "127.0.0.1")
        from phalanx.runtime import bound_tcp_store

        self.store = bound_tcp_store(self.addr, 0, timeout=datetime.timedelta(seconds=max(60, self.start_timeout)))
        # a stalled worker is a lost worker
        self.stalls = ElasticStalls(self.store, self.stall_timeout, silent_s=self.heartbeat_timeout)
        self.notices = HostNotices(self.store)  # a host change announced before its generation
        plan, left = [], self.wanted
        for h, slots in self.hosts.items():
            take = min(slots, left)
            plan += [(h, i, take) for i in range(take)]
            left -= take
        host_index = {h: i for i, h in enumerate(dict.fromkeys(h for h, _, _ in plan))}
        initial = [(h, {"RANK": r, "WORLD_SIZE": len(plan), "LOCAL_RANK": i, "LOCAL_WORLD_SIZE": n,
                        "GROUP_RANK": host_index[h], "GROUP_WORLD_SIZE": len(host_index)})
                   for r, (h, i, n) in enumerate(plan)]
        self.members = []
        started = [self._start(h, e) for h, e in initial]
        self._publish(started, "start")
        print(f"phalanx: elastic job of {len(started)} workers (--min-np {self.min_np}, --max-np {self.max_np}); "
              "a lost worker is recovered in-process (the survivors keep running)", flush=True)
        stop, self.preempt = threading.Event(), ElasticPreemption({**os.environ, **self.env})
        previous = self.preempt.install(stop, self._alive)  # SIGTERM, --preempt-signal: forwarded (exit 85)
        try:
            return self._loop(stop)
        finally:
            self._kill_all()
            self.output.join()
            self.preempt.uninstall(previous)

    def _loop(self, stop: threading.Event) -> int:
        finished, failure = False, None
        next_poll = time.monotonic() + self.interval_s
        next_tick = time.monotonic() + 0.5
        while True:
            if self.preempt.signal is not None:  # forwarded: wait (bounded) for the members' exit 85
                return self.preempt.finish(self.members, self._stop)
            if stop.is_set():
                self._stop({"abort": "interrupted"})
                print("phalanx: interrupted; stopping every worker", file=sys.stderr, flush=True)
                return 130
            changed = []
            for w in self._alive():
                code = w.proc.poll()
                if code is None:
                    if not w.ready and self.store.check([f"pxe/ready/{w.wid}"]):
                        w.ready = True
                        changed.append(f"worker {w.wid} on {w.host} is ready")
                    continue
                rank = self._rank_of(w)
                who = f"rank {rank}" if rank is not None else "joining worker"
                if ended_then_aborted(self.store, w.wid, code):
                    print(f"phalanx: {who} ({w.wid}) ended its script, then aborted in the interpreter's teardown "
                          "(SIGABRT); counted as finished", file=sys.stderr, flush=True)
                    code = 0
                w.code = code
                if code == 0:
                    if self.store.check([f"pxe/left/{w.wid}"]):
                        continue  # left at a shrink
                    if w.admitted and not finished:
                        finished = True
                        self._stop({"done": True})  # workers still waiting to join exit 0
                    continue
                if code == PREEMPTED_EXIT_CODE and w.admitted:  # preempted, not lost: the others follow
                    return self.preempt.finish(self.members, self._stop)
                if code == inprocess.REFORM_FAILED_EXIT:
                    return self._fall_back(f"{who} ({w.wid}) could not re-form in-process")
                what = f"{who} ({w.wid} on {w.host}, pid {w.proc.pid}) failed: {describe_exit(code)}"
                print(f"phalanx: {what}", file=sys.stderr, flush=True)
                if finished:
                    failure = failure or code
                    continue
                self.first_failure = self.first_failure or what
                lost.announce(self.store, w.wid)  # the survivors' watchers end their collectives now (#32)
                if self.horovod_hosts and w.host in self.hosts and w.host not in self.aside.until:
                    wait = self.aside.add(w.host)
                    print(f"phalanx: host {w.host} set aside " + ("for good (no --blacklist-cooldown-range)"
                          if wait == float("inf") else f"for {wait:.1f}s (--blacklist-cooldown-range)"),
                          file=sys.stderr, flush=True)
                changed.append(f"{who} lost; survivors re-form in-process, recovery path: in-process")
            if self.script and not finished and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.interval_s
                hosts = self._discover()
                if hosts is not None and hosts != self.hosts:
                    old_wanted, self.hosts = self.wanted, hosts
                    short = self._wanted() < self.min_np  # (then the members train on, bounded, until slots return)
                    print(f"phalanx: host discovery: {hosts}; {old_wanted} -> {self._wanted()} workers at the next commit"
                          + (f", fewer than --min-np {self.min_np}: the workers train on until there are slots again, "
                             f"for at most --elastic-timeout {self.elastic_timeout:g}s" if short else ""), flush=True)
                    changed.append("host discovery")
            if not finished and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + 0.5
                changed.append("cooldowns and waits")  # a host may be back, a wait may be over
                if self.spare and all(w.admitted for w in self._alive()):  # (not while one joins)
                    self.spare.start(self._base_env())
                by_wid = {w.wid: w for w in self._alive()}
                for s in self.stalls.lost(by_wid):  # killed through its own handle: never by a claimed pid
                    print(f"phalanx: worker {s.rank} {s.reason}; killing it (a stalled worker is a lost worker)",
                          file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        by_wid[s.rank].proc.kill()
            if changed and not finished:
                self.wanted = self._wanted()
                if self._fill(replacing=not self.horovod_hosts) and self.horovod_hosts:
                    self.notices.post(ADDED)  # Horovod's "hosts updated" now; their generation when ready
                abort = self._reconcile("; ".join(changed))
                if abort:
                    print(f"phalanx: {abort}", file=sys.stderr, flush=True)
                    self._stop({"abort": abort})
                    return 1
            if not self._alive() or (finished and not any(w.admitted for w in self._alive())):
                return failure or (0 if finished else 1)  # (joiners never admitted are stopped)
            time.sleep(0.05)

    def _fall_back(self, why: str) -> int:
        n = len([w for w in self.members if w.code is None or w.code == inprocess.REFORM_FAILED_EXIT])
        self._stop({"abort": why})
        self._kill_all()
        if self.fallback is None or any(not is_local(w.host) for w in self.workers):
            print(f"phalanx: {why}; no restart path for this job, stopping", file=sys.stderr, flush=True)
            return inprocess.REFORM_FAILED_EXIT
        n = max(self.min_np, min(max(n, self._wanted()), self.max_np))  # (a grow: the size it grew to)
        print(f"phalanx: {why}; falling back to a full restart of {n} workers from the last commit "
              "(recovery path: group restart on TorchElastic)", file=sys.stderr, flush=True)
        return self.fallback(n, max(1, self.replacements_left))

    def _kill_all(self) -> None:
        if self.spare:  # (also before a fall-back's group restart: it needs no spare)
            self.spare.stop()
        alive = self._alive()
        stop_processes([w.proc for w in alive], _GRACE_S)
        for w in alive:
            w.code = w.proc.returncode
