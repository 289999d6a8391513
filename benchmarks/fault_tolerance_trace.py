"""The timeline of one admission from a run of `benchmarks/fault_tolerance.py --faults add --trace --keep DIR`.

Run:  python benchmarks/fault_tolerance_trace.py DIR/phalanx-4-add-0

Prints every worker's step and `phase` rows (the re-form's steps the worker wrapped: leave, join, runtime
init, re-derive, sync, handover, ...) around the admission, in seconds from the end of the last step at
the old size (t = 0), one line each: rank, start .. end (duration) what.
"""
import json
import sys


def main(out: str) -> None:
    with open(out + "/log.jsonl") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r["what"] == "step"]
    size = max(r["size"] for r in steps)
    full = [r for r in steps if r["size"] == size]
    ranks = {r["pid"]: r["rank"] for r in full}
    base = max(r["t"] for r in steps if r["t"] < full[0]["t"] and r["size"] < size)
    lo, hi = base - 0.05, full[0]["t"] + 0.1
    events = []
    for r in rows:
        if r["what"] == "step" and lo <= r["t"] <= hi:
            events.append((r.get("t_step", r["t"]), r["t"], r["pid"], f"step {r['step']} at size {r['size']}"))
        elif r["what"] == "phase" and r["t"] >= lo and r["t0"] <= hi and r["name"] != "group_sockets":
            events.append((r["t0"], r["t"], r["pid"], r["name"]))
    for start, end, pid, what in sorted(events):
        print(f"rank {ranks.get(pid, '?')} {start - base:+.3f} .. {end - base:+.3f} ({(end - start) * 1e3:5.1f} ms) {what}")


if __name__ == "__main__":
    main(sys.argv[1])
