"""Turn the correctness step's JUnit XML into JSON lines: one per module, one per failing test.

Run:  python benchmarks/gpu/junit_summary.py JUNIT.xml --device cuda --out results.jsonl
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, parser  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("junit")
    args = ap.parse_args()
    if not os.path.exists(args.junit):
        emit(args.out, "correctness", args.device, ok=False, error=f"no JUnit file {args.junit}: pytest did not finish")
        return
    modules: dict[str, dict[str, int]] = {}
    failures = []
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        module = case.get("classname", "?").split(".")[-1]
        counts = modules.setdefault(module, {"passed": 0, "failed": 0, "skipped": 0})
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            failures.append({"test": f"{module}::{case.get('name')}", "message": text[-3000:]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    for module, counts in sorted(modules.items()):
        emit(args.out, "correctness", args.device, module=module, **counts, ok=counts["failed"] == 0)
    for f in failures:
        emit(args.out, "correctness_failure", args.device, **f)


if __name__ == "__main__":
    main()
