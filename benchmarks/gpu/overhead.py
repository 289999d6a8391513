"""Wrapper overhead on a fast device: px.DataParallel and hvd.DistributedOptimizer vs torch DDP.

Run (one GPU, a world of one on NCCL; about a minute on an H100):

    python benchmarks/gpu/overhead.py --device cuda --out results.jsonl
    python benchmarks/gpu/overhead.py --device cpu --out /tmp/o.jsonl     # dry run, seconds

(plain ``python``: a world of one. The dry run is gloo on the CPU with a 2-layer GPT and a
one-block-per-stage ResNet, bf16 autocast on the CPU too, 1 warm-up step, 2 repeats of 1 step.)

On a GPU a training step takes tens of milliseconds, so Python work per gradient (hooks,
bookkeeping, copies issued one by one) that disappears in a CPU step's noise shows here. Two
models built in code (benchmarks/gpu/models.py, no downloads): GPT-2 small (124M parameters,
196 tensors, batch 8 x 1024 tokens, head tied to the embedding) and ResNet-50 (25.6M
parameters, 161 tensors plus 159 BatchNorm buffers, batch 64 of 224x224, channels_last).
Each model is trained by four runners, each on its own copy of the same initial weights, with
the same optimizer (AdamW, fused=True; ``--optimizer foreach`` to change), the same bucket size
(25 MB) and bf16 autocast around forward and loss:

    ddp       torch DistributedDataParallel(model, device_ids=[0])
    ddp_view  the same with gradient_as_bucket_view=True (the peer of phalanx's default)
    phalanx   px.DataParallel(model)
    hvd       a Horovod script: plain model, hvd.DistributedOptimizer(opt, named_parameters=...)

The measurement is paired and interleaved (as benchmarks/dp_vs_ddp.py): ``--warmup`` steps per
runner first (cudnn.benchmark on), then ``--repeats`` repeats; each repeat times every runner for
``--steps`` steps back to back (the device synchronised before and after each timed block), in
the order hvd, ddp, phalanx, ddp_view, reversed every other repeat. The ratios phalanx/ddp,
phalanx/ddp_view and hvd/ddp (steps/s over steps/s; >= 1 means the wrapper is at least as fast)
are taken within each repeat; each gets its median and a ~95% interval of the median. The goal
is 0.98: ``ci_ge_goal`` is true when the whole interval lies at or above it. Two probe steps per
runner after the warm-up estimate the step time; if ``--repeats`` x ``--steps`` would take more
than ``--budget-s`` (30 s) per model, fewer steps per block are timed (``steps`` in the JSON line).

One JSON line per model (step "overhead"): parameters, batch, each runner's median steps/s and
ms/step, each ratio's median and interval, the goal, the verdicts, each runner's last loss (the
runners start from the same weights and see the same batch, so these agree to bf16 noise). A
runner that raises gets a JSON line of its own with the error and the others go on; the exit
status is then 1.

Read the ratios knowing that in a world of one phalanx has nothing to reduce and skips the
reduction (its hook still runs on every gradient, its forward and step wrappers on every step),
while DDP still runs its reducer: copies into buckets, a one-rank allreduce, buffer broadcasts.
So they measure the wrappers' per-step Python cost against DDP's whole reducer, not the cost
of phalanx's reduction path, which needs two ranks.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from common import check_device, emit, median_ci, parser, timed
from models import count_params, gpt2_small, resnet50, tie_head

from phalanx.models import GPT

GOAL = 0.98
ORDER = ("hvd", "ddp", "phalanx", "ddp_view")  # each compared pair adjacent, as in dp_vs_ddp.py
RATIOS = (("phalanx/ddp", "phalanx", "ddp"), ("phalanx/ddp_view", "phalanx", "ddp_view"),
          ("hvd/ddp", "hvd", "ddp"))
MODELS = ("resnet50", "gpt2")


def build_model(name: str, args, device: torch.device):
    """(base model on the CPU, (input, target) on ``device``, loss_fn, description)."""
    tiny = args.device == "cpu"
    torch.manual_seed(0)
    if name == "gpt2":
        seq = 64 if tiny else args.seq
        batch = 4 if tiny else args.gpt_batch
        base = gpt2_small(tiny=tiny)
        vocab = base.config.vocab_size
        ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

        desc = {"batch": batch, "seq": seq, "tokens_per_step": batch * seq, "vocab": vocab}
        return base, (x, y), loss_fn, desc
    if name == "resnet50":
        size = 32 if tiny else 224
        batch = 4 if tiny else args.resnet_batch
        base = resnet50(tiny=tiny)
        x = torch.randn(batch, 3, size, size, device=device)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, base.fc.out_features, (batch,), device=device)
        desc = {"batch": batch, "image": size, "channels_last": args.channels_last}
        return base, (x, y), F.cross_entropy, desc
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def make_optimizer(params, kind: str):
    """AdamW, fused (one kernel for all tensors) or foreach; foreach if fused is refused."""
    params = list(params)
    if kind == "fused":
        try:
            return torch.optim.AdamW(params, lr=1e-4, fused=True), "AdamW(fused=True)"
        except (RuntimeError, ValueError) as e:  # a torch or device without the fused kernel
            print(f"fused AdamW refused ({e}); using foreach", file=sys.stderr)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True), "AdamW(foreach=True)"


def make_runner(kind: str, base, device: torch.device, args):
    """(model, optimizer, optimizer description) for one runner, on its own copy of ``base``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px
    import phalanx.horovod.torch as hvd

    net = copy.deepcopy(base).to(device)  # deepcopy and .to(cuda) keep the GPT's head tied
    if isinstance(net, GPT):
        tie_head(net)  # (a no-op unless the move untied it)
    if args.channels_last and any(p.dim() == 4 for p in net.parameters()):
        net = net.to(memory_format=torch.channels_last)
    if count_params(net) != count_params(base):
        raise RuntimeError(f"{kind}: the copy has {count_params(net)} parameters, the model "
                           f"{count_params(base)}")
    ddp_kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    if kind == "ddp":
        model = DDP(net, bucket_cap_mb=args.bucket_mb, **ddp_kw)
    elif kind == "ddp_view":
        model = DDP(net, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True, **ddp_kw)
    elif kind == "phalanx":
        model = px.DataParallel(net, bucket_mb=args.bucket_mb)
    elif kind == "hvd":
        model = net
    else:
        raise ValueError(kind)
    opt, opt_desc = make_optimizer(model.parameters(), args.optimizer)
    if kind == "hvd":  # as a Horovod script writes it (bucket size: PHALANX_BUCKET_MB, set in main)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt, opt_desc


def make_step(kind: str, base, device: torch.device, args, batch, loss_fn, last: dict):
    """(one training step of runner ``kind``, a function of no arguments; optimizer description)."""
    model, opt, opt_desc = make_runner(kind, base, device, args)
    x, y = batch

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        last[kind] = loss.detach()

    return step, opt_desc


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Runs:
    """The runners of one model, their per-repeat times, and what failed (one JSON line each)."""

    def __init__(self, name: str, args, device: torch.device) -> None:
        self.name, self.args, self.device = name, args, device
        self.steps: dict = {}
        self.last: dict = {}
        self.times: dict[str, list[float]] = {k: [] for k in ORDER}
        self.errors: dict[str, str] = {}

    def fail(self, kind: str, phase: str, e: BaseException) -> None:
        """One shot on the GPU: report the runner's error, drop it, go on with the others."""
        traceback.print_exc()
        self.steps.pop(kind, None)
        self.errors[kind] = f"{phase}: {error_text(e)}"
        emit(self.args.out, "overhead", self.args.device, model=self.name, runner=kind, phase=phase,
             error=error_text(e))
        free(self.device)

    def build(self, base, batch, loss_fn) -> str | None:
        opt_desc = None
        for kind in ORDER:
            try:
                self.steps[kind], opt_desc = make_step(kind, base, self.device, self.args, batch,
                                                       loss_fn, self.last)
            except Exception as e:  # noqa: BLE001
                self.fail(kind, "build", e)
        return opt_desc

    def run(self, kind: str, n: int, phase: str) -> float | None:
        if kind not in self.steps:
            return None
        try:
            return timed(self.steps[kind], self.device, n)
        except Exception as e:  # noqa: BLE001
            self.fail(kind, phase, e)
            return None

    def measure(self) -> int:
        """Warm up, then the paired repeats; returns the steps per timed block it used."""
        for kind in ORDER:  # warm-up: DDP and phalanx re-plan buckets after step 1; cudnn picks
            self.run(kind, self.args.warmup, "warmup")
        probe = [t for t in (self.run(k, 2, "probe") for k in ORDER) if t is not None]
        steps = self.args.steps
        if probe:  # the run is one shot under a time box: fewer steps per block, not a killed run
            fit = self.args.budget_s / (max(probe) * len(probe) * self.args.repeats)
            steps = max(1, min(steps, int(fit)))
        for rep in range(self.args.repeats):
            for kind in ORDER if rep % 2 == 0 else tuple(reversed(ORDER)):
                t = self.run(kind, steps, f"repeat {rep}")
                if t is not None:
                    self.times[kind].append(t)
        return steps

    def losses(self) -> dict[str, float]:
        out = {}
        for k in [k for k in ORDER if k in self.steps]:
            try:
                out[k] = float(self.last[k])
            except Exception as e:  # noqa: BLE001 - an asynchronous CUDA error surfaces here
                self.fail(k, "loss", e)
        return out


def ratio_summary(times: dict[str, list[float]], alive) -> dict:
    ratios = {}
    for label, num, den in RATIOS:
        if num not in alive or den not in alive:
            ratios[label] = None  # a runner failed
            continue
        med, lo, hi = median_ci([d / n for n, d in zip(times[num], times[den])])
        verdict = f">= {GOAL}" if lo >= GOAL else f"< {GOAL}" if hi < GOAL else "unresolved"
        ratios[label] = {"median": round(med, 4), "lo": round(lo, 4), "hi": round(hi, 4),
                         "ci_ge_goal": lo >= GOAL, "verdict": verdict}
    return ratios


def bench_model(name: str, args, device: torch.device, backend: str) -> dict:
    """Build, warm up and time the four runners on one model; emit its JSON line; return it."""
    t_start = time.perf_counter()
    base, batch, loss_fn, desc = build_model(name, args, device)
    nparams, ntensors = count_params(base), sum(1 for _ in base.parameters())
    nbuffers = sum(1 for _ in base.buffers())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = Runs(name, args, device)
    opt_desc = runs.build(base, batch, loss_fn)
    del base
    steps = runs.measure()
    losses = runs.losses()
    alive = [k for k in ORDER if k in runs.steps and len(runs.times[k]) == args.repeats]
    times = runs.times
    ratios = ratio_summary(times, alive)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    errors = runs.errors
    del runs
    free(device)  # this model's runners go before the next model's are built
    return emit(
        args.out, "overhead", args.device, model=name, params=nparams, tensors=ntensors,
        buffers=nbuffers, **desc, world=1, backend=backend, optimizer=opt_desc, autocast="bf16",
        bucket_mb=args.bucket_mb, warmup=args.warmup, repeats=args.repeats, steps=steps,
        steps_capped_by_budget=steps < args.steps,
        steps_per_s={k: round(statistics.median(1.0 / t for t in times[k]), 3) for k in alive},
        ms_per_step={k: round(1e3 * statistics.median(times[k]), 3) for k in alive},
        ratios=ratios, goal=GOAL,
        all_ci_ge_goal=all(r is not None and r["ci_ge_goal"] for r in ratios.values()),
        final_loss={k: round(losses[k], 4) for k in alive}, errors=errors,
        peak_gib=None if peak is None else round(peak, 2),
        wall_s=round(time.perf_counter() - t_start, 1))


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<9} {'runner':<9} {'steps/s':>9} {'ms/step':>9}")
    for row in rows:
        for k in ORDER:
            if k in row["steps_per_s"]:
                print(f"{row['model']:<9} {k:<9} {row['steps_per_s'][k]:>9.2f} "
                      f"{row['ms_per_step'][k]:>9.2f}")
            else:
                print(f"{row['model']:<9} {k:<9} {'failed':>9}  {row['errors'].get(k, '')[:60]}")
    print(f"\nper-repeat ratios (>= 1: the wrapper at least as fast as DDP), goal {GOAL}")
    print(f"{'model':<9} {'ratio':<17} {'median':>7} {'~95% interval':>15}  verdict")
    for row in rows:
        for label, _, _ in RATIOS:
            r = row["ratios"][label]
            if r is None:
                print(f"{row['model']:<9} {label:<17} {'-':>7} {'-':>15}  a runner failed")
            else:
                print(f"{row['model']:<9} {label:<17} {r['median']:>7.3f} "
                      f"{r['lo']:>7.3f}-{r['hi']:<7.3f}  {r['verdict']}")


def init_world(args) -> str:
    """A world of one: gloo on the CPU (dry run); NCCL on cuda:0, or gloo there if NCCL fails."""
    import torch.distributed as dist

    import phalanx as px

    if args.device == "cpu":
        px.init(backend="gloo", device="cpu")
        return "gloo"
    try:
        px.init(backend="nccl", device="cuda:0")
        return "nccl"
    except Exception as e:  # noqa: BLE001 - one shot: measure on gloo rather than not at all
        traceback.print_exc()
        emit(args.out, "overhead", args.device, phase="init", error=error_text(e),
             note="NCCL init failed; measuring on gloo with CUDA tensors instead")
        if dist.is_initialized():
            dist.destroy_process_group()
        px.init(backend="gloo", device="cuda:0")
        return "gloo (nccl init failed)"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated subset of {MODELS}")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up steps per runner (10; dry run 1)")
    ap.add_argument("--repeats", type=int, default=None, help="paired repeats (8; dry run 2)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per runner per repeat (10; dry run 1)")
    ap.add_argument("--gpt-batch", type=int, default=8, help="GPT-2 sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="GPT-2 sequence length (at most 1024)")
    ap.add_argument("--resnet-batch", type=int, default=64, help="ResNet-50 images per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="DDP bucket_cap_mb and phalanx bucket_mb")
    ap.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                    help="AdamW implementation")
    ap.add_argument("--budget-s", type=float, default=30.0,
                    help="seconds for one model's timed repeats; fewer steps per block if the "
                         "probed step time needs it (run.sh time-boxes the whole script)")
    ap.add_argument("--no-channels-last", dest="channels_last", action="store_false",
                    help="ResNet in NCHW instead of channels_last")
    args = ap.parse_args()
    check_device(args.device)
    dry = args.device == "cpu"
    args.warmup = args.warmup if args.warmup is not None else 1 if dry else 10
    args.repeats = args.repeats if args.repeats is not None else 2 if dry else 8
    args.steps = args.steps if args.steps is not None else 1 if dry else 10
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--repeats and --steps must be >= 1, --warmup >= 0")
    if not 1 <= args.seq <= 1024:
        ap.error(f"--seq {args.seq}: GPT-2's positions cover 1..1024")

    # hvd.DistributedOptimizer's bucket size is the job's (a Horovod script passes none): set it
    # before init, which reads it
    os.environ["PHALANX_BUCKET_MB"] = str(args.bucket_mb)
    import phalanx as px

    backend = init_world(args)
    if px.size() != 1:
        raise SystemExit(f"error: this benchmark is a world of one (plain python); got {px.size()}")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if dry:  # one intra-op thread: on a small shared CPU spinning OpenMP workers make it erratic
        torch.set_num_threads(1)
    else:
        torch.backends.cudnn.benchmark = True
    print(f"{'dry run: ' if dry else ''}{args.device}, world 1 on {backend}, "
          f"torch {torch.__version__}, {args.warmup} warm-up steps, "
          f"{args.repeats} repeats x {args.steps} steps, "
          f"bucket {args.bucket_mb} MB, bf16 autocast", flush=True)
    rows, failed = [], "failed" in backend
    t0 = time.perf_counter()
    for name in names:
        try:
            row = bench_model(name, args, device, backend)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the model: go on
            traceback.print_exc()
            emit(args.out, "overhead", args.device, model=name, error=error_text(e))
            failed = True
            free(device)
            continue
        rows.append(row)
        failed = failed or bool(row["errors"])
    if rows:
        print_table(rows)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
