"""Host discovery for elastic runs: run ``--host-discovery-script``, read ``host:slots`` lines.

horovodrun's model: a script prints the hosts now available, one ``host:slots`` per
line; the launcher (:mod:`phalanx.launcher.supervisor`) polls it every
``--discovery-interval`` seconds and changes the job at the next commit::

    more slots (this machine or a new remote host) ─ start workers there (SSH for a remote host)
        ─ they register as pending ─ next state.commit(): everyone re-forms in-process, them included
    fewer slots ─ the surplus workers leave at the next commit (exit 0); the rest re-form

The wanted size is the total of the slots listed, clamped to ``--min-np``..``--max-np``.
A host is the name the script prints, as in Horovod: ``localhost`` and ``127.0.0.1`` are two
hosts (both started on this machine, without SSH), each worker's ``HOROVOD_HOSTNAME`` is that
name, and a host whose worker failed is set aside as a whole.
A failed or malformed script run is logged and ignored (the job keeps its hosts).

Example::

    $ cat hosts.sh
    #!/bin/sh
    echo localhost:2; cat /etc/phalanx-extra-hosts     # e.g. "node7:2"
    $ phalanx run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py
"""

from __future__ import annotations

import subprocess

from phalanx.launcher.hosts import is_local
from phalanx.launcher.ssh import probe
from phalanx.log import get_logger

__all__ = ["discover_hosts", "discover_slots", "discover_reachable"]

log = get_logger(__name__)


def discover_hosts(script: str, timeout_s: float = 30.0) -> dict[str, int]:
    """Run the discovery script once; return ``{host: slots}`` in the order printed, names as printed.

    Raises ValueError (with the offending line) or subprocess errors on a bad run.
    """
    out = subprocess.run([script], capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    hosts: dict[str, int] = {}
    for line in filter(None, (s.strip() for s in out.splitlines())):
        name, _, slots = line.rpartition(":") if ":" in line else (line, "", "1")
        if not name or not slots.isdigit() or any(c.isspace() for c in name):  # (a name has no spaces)
            raise ValueError(f"host discovery script {script} printed {line!r}; print host:slots lines")
        hosts[name] = hosts.get(name, 0) + int(slots)
    return hosts


def discover_slots(script: str, timeout_s: float = 30.0) -> int:
    """The slots the discovery script lists for this machine (all its names; remote hosts are not counted)."""
    return sum(n for h, n in discover_hosts(script, timeout_s).items() if is_local(h))


def discover_reachable(script, probed: set[str], ssh, timeout_s: float,
                       warned: set[str] | None = None) -> dict[str, int] | None:
    """The elastic supervisor's discovery round: ``{host: slots}`` from ``script`` (a discovery script's
    path, or a function giving the slots), less the remote hosts ``ssh host true`` cannot reach (each
    named in a warning; those reached once are added to ``probed`` and not probed again). None when
    the script failed: the caller keeps the hosts it knows. ``warned``: the failures already said; one
    that repeats at every poll is said once, until a round succeeds."""
    try:
        hosts = script() if callable(script) else discover_hosts(script, timeout_s=timeout_s)
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        if warned is None or str(err) not in warned:
            log.warning("host discovery script failed (%s); keeping the hosts known (said once while it fails "
                        "this way)", err)
            if warned is not None:
                warned.add(str(err))
        return None
    if warned is not None:
        warned.clear()
    for h in [h for h in hosts if not (is_local(h) or h in probed or callable(script))]:
        try:
            probe([h], ssh, timeout_s=15)
            probed.add(h)
        except RuntimeError as err:
            log.warning("host discovery lists %s but it cannot be used: %s; ignored", h, err)
            hosts.pop(h)
    return hosts
