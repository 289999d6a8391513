"""What one data-parallel training step costs in Python and in torch ops: hvd vs DataParallel vs DDP.

Run:  python benchmarks/dp_step_profile.py [--model "small transformer" --steps 50 --top 25]

Not a speed benchmark (profiling slows every path): it counts, on rank 0 of a 2-rank gloo
run, what each path does per step on the same model as ``benchmarks/dp_vs_ddp.py``:

- Python function calls per step (cProfile), and the functions with the most own time;
- torch ops per step by name (``torch.profiler``: copies, allocations, collectives);
- how many gradients arrive before the first bucket is launched, and how many buckets.

Paths: ``hvd`` (``phalanx.horovod.torch.DistributedOptimizer`` on the plain model),
``phalanx`` (``px.DataParallel`` + plain SGD), ``ddp`` (torch DDP + plain SGD).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats


def _setup(kind: str, model_name: str, batch: int, bucket_mb: float):
    import os

    import torch
    from dp_vs_ddp import models  # this script's folder (sys.path[0])
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px
    import phalanx.horovod.torch as hvd

    os.environ["PHALANX_BUCKET_MB"] = str(bucket_mb)
    torch.manual_seed(0)
    model, shape, classes = models()[model_name]()
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, classes, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    if kind == "ddp":
        model = DDP(model, bucket_cap_mb=bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    elif kind == "phalanx":
        model = px.DataParallel(model, bucket_mb=bucket_mb, broadcast_buffers=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return model, opt, step


def _launch_trace(model, opt):
    """Wrap the engine's bucket launch: how many gradients were in when each bucket launched."""
    engine = getattr(model, "_engine", None) or getattr(opt, "_engine", None)
    if engine is None:
        return None
    seen = {"grads": 0, "launches": []}
    hook, launch = engine._hook, engine.reduction.launch

    def counting_hook(p):
        seen["grads"] += 1
        hook(p)

    def counting_launch(bucket):
        seen["launches"].append(seen["grads"])
        launch(bucket)

    for h in engine._hooks:
        h.remove()
    engine._hooks = [p.register_post_accumulate_grad_hook(counting_hook) for p in engine._hooked]
    engine.reduction.launch = counting_launch
    return seen


def _profile(kind: str, model_name: str, steps: int, top: int, batch: int, bucket_mb: float):
    import torch

    import phalanx as px

    model, opt, step = _setup(kind, model_name, batch, bucket_mb)
    for _ in range(5):  # warm-up: buckets re-planned after the first step
        step()
    seen = _launch_trace(model, opt)
    if seen is not None:
        seen["grads"], seen["launches"] = 0, []
        step()
        launches = f"{len(seen['launches'])} bucket(s), launched after {seen['launches']} of {seen['grads']} grads"
    else:
        launches = "torch DDP (C++ reducer: not traced)"
    px.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    calls = sum(v[1] for v in stats.stats.values())  # primitive + recursive calls
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    ours = sorted(((nc / steps, tt / steps * 1e6, f"{file.split('phalanx/', 1)[-1]}:{line}({fn})")
                   for (file, line, fn), (_, nc, tt, _, _) in stats.stats.items()
                   if "/phalanx/" in file and "/benchmarks/" not in file), key=lambda r: -r[1])
    out.write("phalanx functions: calls/step, own us/step\n")
    for n, us, where in ours:
        out.write(f"  {n:8.1f} {us:9.1f}  {where}\n")
    px.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            step()
    ops = collections.Counter()
    for ev in tp.key_averages():
        ops[ev.key] = ev.count / steps
    px.barrier()
    return {"calls": calls / steps, "launches": launches, "stats": out.getvalue(), "ops": dict(ops)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small transformer")
    ap.add_argument("--kinds", default="hvd,phalanx,ddp")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=25, help="functions shown per path (by own time)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--ops", default="aten::copy_,aten::_foreach_copy_,aten::empty,aten::empty_strided,"
                    "aten::zero_,aten::zeros,aten::fill_,aten::mul_,aten::div_,aten::clone,aten::add_,"
                    "aten::_foreach_add_,aten::set_", help="torch ops shown per step (comma separated)")
    args = ap.parse_args()
    import phalanx as px

    kinds = args.kinds.split(",")
    res = {k: px.run(_profile, np=2, args=(k, args.model, args.steps, args.top, args.batch, args.bucket_mb),
                     threads=1, timeout=900)[0] for k in kinds}
    for k in kinds:
        print(f"===== {k}: {res[k]['calls']:.0f} Python calls/step; {res[k]['launches']}")
        print(res[k]["stats"])
    names = args.ops.split(",")
    print(f"{'torch op per step':<28}" + "".join(f"{k:>10}" for k in kinds))
    for name in names + sorted({n for k in kinds for n in res[k]["ops"]
                                if ("gloo" in n or "all_reduce" in n or "allreduce" in n) and n not in names}):
        print(f"{name:<28}" + "".join(f"{res[k]['ops'].get(name, 0):>10.1f}" for k in kinds))


if __name__ == "__main__":
    main()
