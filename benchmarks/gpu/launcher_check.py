"""The launcher as a user meets it on a one-GPU machine: `phalanx run` picks NCCL and cuda:0, says
in one line why two NCCL ranks cannot share the GPU, and shares it over gloo when told to.

Run:  python benchmarks/gpu/launcher_check.py --device cuda --out results.jsonl
      python benchmarks/gpu/launcher_check.py --device cpu      (the dry run: gloo on the CPU)
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser  # noqa: E402

SCRIPT = ("import torch, phalanx as px; t = px.init(); "
          "s = px.allreduce(torch.ones(2, device=t.device) * (t.rank + 1), op=px.Sum); "
          "print('RESULT', t.rank, t.backend, t.device, s.device.type, s.tolist(), flush=True)")


def _launch(np: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(np), sys.executable, "-c", SCRIPT]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def main() -> None:
    ap = parser(__doc__)
    args = ap.parse_args()
    check_device(args.device)
    cases = [("np1_default", 1, {}), ("np2_gloo_shared_gpu", 2, {"PHALANX_BACKEND": "gloo"})]
    if args.device == "cuda":
        cases.append(("np2_nccl_one_gpu_refused", 2, {}))
    else:  # the dry run: the two-rank case alone (on a CPU the default is gloo too)
        cases = [("np2_gloo_shared_gpu", 2, {"PHALANX_BACKEND": "gloo", "PHALANX_DEVICE": "cpu"})]
    for name, np, env in cases:
        try:
            p = _launch(np, env)
        except subprocess.TimeoutExpired:
            emit(args.out, "launcher", args.device, case=name, ok=False, error="timed out after 120 s")
            continue
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
        results = [ln.split("RESULT", 1)[1].split() for ln in lines if "RESULT" in ln]
        if name.endswith("refused"):
            said = [ln for ln in lines if "NCCL needs a GPU per rank" in ln]
            ok = p.returncode != 0 and bool(said) and not any("Traceback" in ln for ln in lines)
            emit(args.out, "launcher", args.device, case=name, rc=p.returncode, said=said[:1],
                 lines=len(lines), ok=ok, tail=lines[-6:])
            continue
        want = "nccl" if (args.device == "cuda" and np == 1) else "gloo"
        total = float(sum(range(1, np + 1)))
        ok = (p.returncode == 0 and len(results) == np
              and all(r[1] == want and r[2].startswith(args.device) and r[3] == args.device for r in results)
              and all(" ".join(r[4:]) == f"[{total}, {total}]" for r in results))
        emit(args.out, "launcher", args.device, case=name, rc=p.returncode, results=results, ok=ok,
             tail=lines[-6:] if not ok else [])


if __name__ == "__main__":
    main()
