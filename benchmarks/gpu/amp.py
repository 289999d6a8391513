"""Mixed precision on 2 ranks: phalanx's wrappers against ``torch.amp`` + DDP, step for step.

Run:  python benchmarks/gpu/amp.py --device cuda --out results.jsonl      (2 gloo ranks on cuda:0)
      python benchmarks/gpu/amp.py --device cpu                           (the dry run, seconds)

Two ranks share one GPU on gloo (NCCL refuses two ranks on one device; gloo moves CUDA tensors
through pinned host memory). Each rank trains three copies of the same small transformer block
from the same weights on the same batches: torch DDP, ``px.DataParallel`` and a Horovod script's
``hvd.DistributedOptimizer`` (its AMP recipe: ``synchronize()``, ``unscale_``, then
``skip_synchronize()`` around ``scaler.step``), each under ``torch.autocast``:

- fp16 with ``torch.amp.GradScaler``: at step ``--inf-step`` rank 1 alone multiplies its loss by
  inf. The averaged gradient is then inf on every rank, so every rank's scaler must skip that step
  and halve its scale, as DDP's does.
- bf16 without a scaler (bf16 has fp32's range), no forced inf.

One JSON line per (precision, runner): the largest |loss - DDP's loss| over the steps, the largest
|parameter - DDP's parameter| at the end, the steps each rank skipped, the final scale. It passes
when the losses and parameters agree with DDP's to ``--tol`` and every rank skipped exactly the
forced step (fp16) or none (bf16).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_device, emit, parser  # noqa: E402

RUNNERS = ("ddp", "phalanx", "hvd")


class Block(nn.Module):
    """A pre-norm transformer block and a classifier head: attention, MLP, LayerNorm, GELU."""

    def __init__(self, d: int, heads: int, classes: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(1))


def _wrap(kind: str, model: nn.Module, device: torch.device):
    """(module to call, optimizer, Horovod-style or not)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px
    import phalanx.horovod.torch as hvd

    if kind == "ddp":
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), False
    if kind == "phalanx":
        dp = px.DataParallel(model)
        return dp, torch.optim.AdamW(dp.parameters(), lr=1e-3), False
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    return model, opt, True


def _train(kind, base, batches, precision, inf_step, device):
    import phalanx as px

    model = copy.deepcopy(base)
    module, opt, horovod = _wrap(kind, model, device)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12, enabled=precision == "fp16")
    losses, skipped = [], []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = nn.functional.cross_entropy(module(x), y)
        losses.append(float(loss.detach()))
        if precision == "fp16" and step == inf_step and px.rank() == 1:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        if horovod:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
            skipped.append(step)
    params = [p.detach().float().cpu() for p in model.parameters()]
    return losses, skipped, scaler.get_scale() if scaler.is_enabled() else None, params


def _rank(args):
    import phalanx as px

    topo = px.topology()
    device = topo.device
    torch.manual_seed(0)
    base = Block(args.d, args.heads, 10).to(device)
    g = torch.Generator().manual_seed(100 + topo.rank)  # each rank its own batches
    batches = [(torch.randn(args.batch, args.seq, args.d, generator=g).to(device),
                torch.randint(0, 10, (args.batch,), generator=g).to(device)) for _ in range(args.steps)]
    out = {}
    for precision in ("fp16", "bf16"):
        for kind in RUNNERS:
            try:
                out[(precision, kind)] = _train(kind, base, batches, precision, args.inf_step, device)
            except Exception as exc:  # noqa: BLE001 - one shot on the GPU: report it and go on
                out[(precision, kind)] = f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--inf-step", type=int, default=3, help="the fp16 step at which rank 1's loss is inf")
    ap.add_argument("--tol", type=float, default=None, help="default 2e-3 (cuda) / 1e-2 (cpu)")
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    check_device(args.device)
    cpu = args.device == "cpu"
    args.d, args.heads, args.seq, args.batch = (32, 4, 8, 4) if cpu else (512, 8, 128, 16)
    if cpu:
        args.steps = min(args.steps, 5)
    tol = args.tol if args.tol is not None else (1e-2 if cpu else 2e-3)

    import phalanx as px

    env = {"PHALANX_BACKEND": "gloo", "PHALANX_DEVICE": "cpu" if cpu else "cuda:0"}
    results = px.run(_rank, np=2, args=(args,), env=env, timeout=args.timeout)
    for precision in ("fp16", "bf16"):
        want_skip = [args.inf_step] if precision == "fp16" else []
        ddp = [r[(precision, "ddp")] for r in results]
        for kind in RUNNERS:
            mine = [r[(precision, kind)] for r in results]
            errors = [m for m in mine if isinstance(m, str)] + [d for d in ddp if isinstance(d, str)]
            if errors:
                emit(args.out, "amp", args.device, precision=precision, runner=kind, ok=False, error=errors[0])
                continue
            loss_diff = max(abs(a - b) for m, d in zip(mine, ddp) for a, b in zip(m[0], d[0])
                            if a == a and b == b)  # NaN-free steps (the forced one is skipped)
            param_diff = max((a - b).abs().max().item() for m, d in zip(mine, ddp) for a, b in zip(m[3], d[3]))
            skipped = [m[1] for m in mine]
            scales = [m[2] for m in mine]
            ok = (loss_diff <= tol and param_diff <= tol and all(s == want_skip for s in skipped)
                  and len(set(scales)) == 1 and scales[0] == ddp[0][2])
            emit(args.out, "amp", args.device, precision=precision, runner=kind, steps=args.steps,
                 max_loss_diff_vs_ddp=loss_diff, max_param_diff_vs_ddp=param_diff, tol=tol,
                 skipped_per_rank=skipped, want_skipped=want_skip, scale_per_rank=scales,
                 ddp_scale=ddp[0][2], ok=ok)


if __name__ == "__main__":
    main()
