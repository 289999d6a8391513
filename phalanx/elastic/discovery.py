"""Host discovery for elastic runs: poll ``--host-discovery-script``, resize the job at the next commit.

horovodrun's model: a script prints the hosts now available, one ``host:slots`` per
line; the driver polls it and new workers are admitted at the next ``commit()``.
On one host phalanx does the same around TorchElastic's agent, whose worker group
has a fixed size::

    launcher: poll script every --discovery-interval s ─ wanted np != running np ─ write resize file
    workers:  state.commit() ─ rank 0 reads the resize file, broadcasts it ─ everyone exits 0
    launcher: group ended with the resize pending ─ start a group of the new size (same run id)
    workers:  run(train)(state) restores that very commit (no step lost), resharded, and the
              on_world_change hooks rescale the LR or the per-rank batch

The wanted size is the script's slots on this machine, clamped to ``--min-np``..``--max-np``.
A failed or malformed script run is logged and ignored (the job keeps its size).
Other hosts in the output are logged and ignored here: admitting a remote host needs an
agent started on it (``phalanx run -H`` / another ``phalanx run`` on the same rendezvous).

Example::

    $ cat hosts.sh
    #!/bin/sh
    echo localhost:$(cat /etc/phalanx-slots)
    $ phalanx run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
import threading

from phalanx.log import get_logger

__all__ = ["discover_hosts", "discover_slots", "launch_with_discovery", "resize_requested", "ResizeRequested", "RESIZE_ENV"]

log = get_logger(__name__)
RESIZE_ENV = "PHALANX_RESIZE_FILE"


def discover_hosts(script: str, timeout_s: float = 30.0) -> dict[str, int]:
    """Run the discovery script once; return ``{host: slots}`` in the order printed (this
    machine's names all become ``"localhost"``).

    Raises ValueError (with the offending line) or subprocess errors on a bad run.
    """
    out = subprocess.run([script], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    here = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    hosts: dict[str, int] = {}
    for line in filter(None, (s.strip() for s in out.splitlines())):
        name, _, slots = line.rpartition(":") if ":" in line else (line, "", "1")
        if not name or not slots.isdigit():
            raise ValueError(f"host discovery script {script} printed {line!r}; print host:slots lines")
        name = "localhost" if name in here else name
        hosts[name] = hosts.get(name, 0) + int(slots)
    return hosts


def discover_slots(script: str, timeout_s: float = 30.0) -> int:
    """The slots the discovery script lists for this machine (remote hosts are not counted)."""
    return discover_hosts(script, timeout_s).get("localhost", 0)


class ResizeRequested(Exception):
    """Raised by ``TorchState.commit()`` on every rank when the launcher wants another worker count;
    ``phalanx.elastic.run`` ends the workers cleanly (exit 0) and the launcher restarts them at the
    new size from this commit."""

    def __init__(self, running: int, wanted: int) -> None:
        super().__init__(f"resize from {running} to {wanted} workers requested by host discovery")
        self.running, self.wanted = running, wanted


def resize_requested(path: str | None = None) -> int | None:
    """The worker count the launcher wants now (``$PHALANX_RESIZE_FILE``), or None."""
    path = path or os.environ.get(RESIZE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _clamp(slots: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, slots))


def launch_with_discovery(launch, spec, command: list[str], script: str, min_np: int, max_np: int,
                          interval_s: float = 1.0) -> int:
    """Run ``launch(spec, command)`` (the launcher's local agent), starting it again at the size
    the discovery script asks for each time the workers stop at a commit to resize."""
    np = spec.nproc_per_node
    try:
        found = discover_slots(script)
        if found:
            np = _clamp(found, min_np, max_np)
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        log.warning("host discovery script failed (%s); starting with -np %d", err, np)
    workdir = tempfile.mkdtemp(prefix="phalanx-discovery-")
    resize_file = os.path.join(workdir, "resize")
    env = {**spec.env, RESIZE_ENV: resize_file}
    while True:
        with open(resize_file + ".tmp", "w") as f:
            f.write(str(np))
        os.replace(resize_file + ".tmp", resize_file)  # = the running size: nothing to do yet
        stop = threading.Event()
        poller = threading.Thread(target=_poll, args=(script, min_np, max_np, np, resize_file, interval_s, stop),
                                  name="phalanx-discovery", daemon=True)
        poller.start()
        try:
            code = launch(dataclasses.replace(spec, nproc_per_node=np, env=env), command)
        finally:
            stop.set()
            poller.join()
        wanted = resize_requested(resize_file)
        if code != 0 or wanted is None or wanted == np:
            return code
        log.warning("host discovery: resizing from %d to %d workers (resuming from the last commit)", np, wanted)
        print(f"phalanx: resizing from {np} to {wanted} workers at the last commit", flush=True)
        np = wanted


def _poll(script: str, min_np: int, max_np: int, running: int, resize_file: str, interval_s: float,
          stop: threading.Event) -> None:
    last = running
    while not stop.wait(interval_s):
        try:
            slots = discover_slots(script, timeout_s=max(interval_s, 5.0))
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            log.warning("host discovery script failed (%s); keeping %d workers", err, last)
            continue
        if not slots:
            log.warning("host discovery lists no slots on this machine; keeping %d workers", last)
            continue
        wanted = _clamp(slots, min_np, max_np)
        if wanted != last:
            log.warning("host discovery: %d slots here, asking the workers to resize to %d at the next "
                        "commit", slots, wanted)
            with open(resize_file + ".tmp", "w") as f:
                f.write(str(wanted))
            os.replace(resize_file + ".tmp", resize_file)
            last = wanted
