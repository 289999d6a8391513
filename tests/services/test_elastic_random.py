"""A seeded, bounded random sequence of membership changes through `phalanx run`: SIGKILLs, exceptions,
grows and shrinks (by the discovery script) on three hosts of this machine (localhost, 127.0.0.1 and
its hostname), with --blacklist-cooldown-range so a host set aside comes back. Asserts completion,
bitwise-equal replicas and no worker left behind. Short by default; PHALANX_ELASTIC_RANDOM_EVENTS=N
(default 3) for a longer one, PHALANX_ELASTIC_RANDOM_SEED to vary it."""

import os
import random
import socket
import subprocess

import pytest
import test_elastic_membership as tm

pytestmark = pytest.mark.ranks


def _schedule(rng, events, epochs, batches, hosts):
    """Per-epoch discovery output and failures: each event a grow/shrink (an epoch's host set) or a
    failure (kill or exception) of a random worker id at a random (epoch, batch)."""
    current = hosts[:2]
    per_epoch = {0: "".join(f"{h}:2\n" for h in current)}
    exits: dict[str, list[str]] = {}
    for _ in range(events):
        epoch = rng.randrange(1, epochs)
        if rng.random() < 0.5:
            current = rng.sample(hosts, rng.randint(1, len(hosts)))  # grow or shrink (2..6 workers)
            per_epoch[epoch] = "".join(f"{h}:2\n" for h in current)
        else:
            wid = f"w{rng.randrange(0, 6)}"
            exits.setdefault(f"{epoch},{rng.randrange(batches)}", []).append(
                rng.choice(["", "kill:"]) + wid)
    # an epoch without its own entry keeps the previous one's hosts
    filled, last = {}, per_epoch[0]
    for e in range(epochs):
        last = filled[e] = per_epoch.get(e, last)
    return filled, exits


def test_random_membership_changes_end_in_one_consistent_group(tmp_path):
    seed = int(os.environ.get("PHALANX_ELASTIC_RANDOM_SEED", "32"))
    events = int(os.environ.get("PHALANX_ELASTIC_RANDOM_EVENTS", "3"))
    epochs, batches = max(4, events + 2), 3
    rng = random.Random(seed)
    hosts = ["localhost", "127.0.0.1", socket.gethostname()]
    per_epoch, exits = _schedule(rng, events, epochs, batches, hosts)
    print(f"\nseed {seed}: hosts per epoch {per_epoch}, failures {exits}")
    proc, rows, report = tm._run(tmp_path, "hvd", per_epoch, "-np", "2", "--min-np", "2", "--max-np", "6",
                                 "--blacklist-cooldown-range", "1", "2", exits=exits, epochs=epochs,
                                 batches=batches, timeout=120 + 60 * events, change_wait=20)
    report = f"seed {seed}, hosts {per_epoch}, failures {exits}\n{report}"
    assert proc.returncode == 0, report
    ends = [r for r in rows if r["what"] == "end"]
    assert len(ends) >= 2 and {r["size"] for r in ends} == {len(ends)}, report
    tm._equal_params(tmp_path, len(ends), report)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "job.py")], capture_output=True, text=True).stdout.split()
    assert not left, f"workers left behind: {left}\n{report}"
