"""``phalanx plan``: rank parallel layouts by predicted step time under a memory budget.

Example::

    phalanx plan --params 1.3e9 --layers 24 --compute-ms 900 --hosts 4 --ranks-per-host 8 --memory-gb 40
    phalanx plan --model torch.nn:Transformer --hosts 2 --ranks-per-host 2 --inter-gbps 1
    phalanx plan --gpus 1024 --hardware h100-ib400 --model gpt-13b      # a named model on named hardware
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The cluster cost model's flags: a --hardware plan prices a named workload on a named machine and reads none of them.
_COST_MODEL_ONLY = ("params", "layers", "compute_ms", "act_mb", "experts", "expert_params", "moe_layers", "top_k",
                    "hosts", "ranks_per_host", "intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us",
                    "overlap", "memory_gb")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank dp/pp/tp/ZeRO/compression/bucket layouts by predicted step time",
                              description="Predict step time of every layout with the alpha-beta cost model.")
    p.add_argument("--params", type=float, default=None, help="trainable parameters (e.g. 1.3e9)")
    p.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="build a model to count its parameters instead of --params")
    p.add_argument("--layers", type=int, default=1, help="layers to split over pipeline/tensor parallel")
    p.add_argument("--compute-ms", type=float, default=100.0,
                   help="forward+backward+optimizer of one global batch on one rank (measured)")
    p.add_argument("--act-mb", type=float, default=0.0, help="activation MB per layer for the global batch")
    p.add_argument("--experts", type=int, default=0,
                   help="a mixture-of-experts model: experts per MoE layer (then ep is searched too)")
    p.add_argument("--expert-params", type=float, default=0.0, help="how many of --params sit in experts")
    p.add_argument("--moe-layers", type=int, default=0, help="MoE layers (default: --layers when --experts)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--intra-gbps", type=float, default=100.0, help="intra-host bandwidth, Gbit/s")
    p.add_argument("--inter-gbps", type=float, default=10.0, help="inter-host bandwidth, Gbit/s")
    p.add_argument("--intra-latency-us", type=float, default=5.0)
    p.add_argument("--inter-latency-us", type=float, default=50.0)
    p.add_argument("--overlap", type=float, default=1.0,
                   help="share of communication that hides behind backward, in [-1, 1]: 1 = a network engine of "
                        "its own, 0 = it needs the cores compute uses (measure: phalanx.planner.calibrate."
                        "measure_overlap); default 1")
    p.add_argument("--memory-gb", type=float, default=float("inf"), help="memory budget per rank, GiB")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help="a named hardware profile (planner.hardware, e.g. h100-ib400); with --gpus and a named "
                        "--model (planner.workloads, e.g. gpt-13b) it ranks dp x tp x pp layouts on that machine")
    p.add_argument("--gpus", type=int, default=None, help="GPUs for --hardware")
    p.add_argument("--state-bits", type=int, default=32, choices=(32, 8),
                   help="optimizer state in 32 bits or block-wise 8 bits (px.zero(..., state_bits=8)), for --hardware")
    p.add_argument("--batch-per-gpu", type=float, default=None,
                   help="samples per GPU for --hardware (default 64 images or 2 sequences)")
    p.set_defaults(func=main, cost_model_defaults={dest: p.get_default(dest) for dest in _COST_MODEL_ONLY})


def _model_sizes(spec: str) -> tuple[int, tuple[float, ...]]:
    """Trainable parameters, and each one's gradient bytes in the order backward produces them
    (reversed definition order, as for a sequential model): the engine's buckets come from these."""
    module, _, attr = spec.partition(":")
    if not attr or not module:
        raise ValueError(f"--model {spec!r}: use MODULE:FACTORY, e.g. torch.nn:Transformer")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {spec!r}: cannot find {attr} in {module} ({err})") from None
    try:
        model = factory()
    except Exception as err:  # the user's factory: any failure is theirs to fix, in one line
        raise ValueError(f"--model {spec!r}: {attr}() failed ({type(err).__name__}: {err}); FACTORY must build "
                         "the model with no arguments, e.g. a function in your module") from None
    if not hasattr(model, "parameters"):
        raise ValueError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), tuple(float(p.numel() * 4) for p in reversed(params) if p.numel())


def _workload_names() -> list[str]:
    from phalanx.planner import workloads

    return workloads.names()


def _check(args: argparse.Namespace) -> None:
    """Numbers the cost model cannot use: one line naming the flag."""
    for flag, value, least in (("--hosts", args.hosts, 1), ("--ranks-per-host", args.ranks_per_host, 1),
                               ("--layers", args.layers, 1), ("--top", args.top, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps),
                        ("--memory-gb", args.memory_gb), ("--compute-ms", args.compute_ms)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    for flag, value in (("--act-mb", args.act_mb), ("--intra-latency-us", args.intra_latency_us),
                        ("--inter-latency-us", args.inter_latency_us)):
        if value < 0:
            raise ValueError(f"{flag} must not be negative, got {value}")
    if args.experts and (args.experts < 1 or not args.expert_params > 0 or not args.act_mb > 0):
        raise ValueError(f"--experts {args.experts} needs --expert-params (> 0) and --act-mb (> 0): the experts' "
                         "share of the parameters, and the activations the all-to-alls carry")
    if args.experts and not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if args.experts and not 0 <= args.moe_layers <= args.layers:
        raise ValueError(f"--moe-layers {args.moe_layers} must be between 1 and --layers {args.layers} "
                         "(0: every layer)")
    if args.experts and args.params is not None and args.expert_params > args.params:
        raise ValueError(f"--expert-params {args.expert_params:g} is more than --params {args.params:g}: it is the "
                         "share of --params that sits in experts")
    if args.params is not None and not args.params > 0:
        raise ValueError(f"--params must be positive, got {args.params}")
    if not -1 <= args.overlap <= 1:
        raise ValueError(f"--overlap must be in [-1, 1], got {args.overlap}")


def _check_hardware(args: argparse.Namespace) -> None:
    """A --hardware plan's flags: one line naming the flag (a flag it would ignore included)."""
    from phalanx.planner import hardware, workloads

    missing = [flag for flag, value in (("--hardware NAME", args.hardware), ("--gpus N", args.gpus),
                                        ("--model NAME", args.model)) if value is None]
    if missing:
        raise ValueError(f"a --hardware plan needs {' and '.join(missing)} too (give --hardware NAME, --gpus N and "
                         "--model NAME together; for a model of your own drop them and give --params N)")
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    if args.batch_per_gpu is not None and not args.batch_per_gpu > 0:
        raise ValueError(f"--batch-per-gpu must be positive, got {args.batch_per_gpu:g}")
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.hardware not in hardware.names() and (
            "/" in args.hardware or args.hardware.endswith((".json", ".yaml", ".yml", ".toml"))):
        raise ValueError(f"--hardware {args.hardware!r}: takes a profile name, not a file; choose one of "
                         f"{', '.join(hardware.names())}")
    if args.model not in workloads.names():
        raise ValueError(f"unknown model {args.model!r} for a --hardware plan; choose one of {', '.join(workloads.names())}; "
                         "a model of your own (MODULE:FACTORY or --params N) goes without --hardware/--gpus")
    w, gpu = workloads.get(args.model), hardware.get(args.hardware).gpu
    if w.precision not in gpu.peak:  # (the profile's own error named a precision no flag chooses)
        fits = [h for h in hardware.names() if w.precision in hardware.get(h).gpu.peak]
        models = [m for m in workloads.names() if workloads.get(m).precision in gpu.peak]
        raise ValueError(f"--model {args.model} trains in {w.precision}, for which --hardware {args.hardware} has no "
                         f"peak (it has {', '.join(sorted(gpu.peak))}); choose hardware with {w.precision} "
                         f"({', '.join(fits[:4])}, ...) or a model it has a peak for ({', '.join(models[:4])}, ...)")
    defaults = getattr(args, "cost_model_defaults", {})
    ignored = ["--" + dest.replace("_", "-") for dest, default in defaults.items() if getattr(args, dest) != default]
    if ignored:
        raise ValueError(f"{', '.join(ignored)}: the cluster cost model's, unused by a --hardware plan (it reads the "
                         "named model and machine); drop them, or drop --hardware/--gpus to use them")


def main(args: argparse.Namespace) -> int:
    from phalanx.planner import cost, plan, scaling

    if args.hardware is not None or args.gpus is not None:
        try:
            _check_hardware(args)
            print("\n".join(scaling.plan(args.model, args.hardware, args.gpus, batch_per_gpu=args.batch_per_gpu,
                                         top=args.top, state_bits=args.state_bits)))
        except ValueError as err:
            print(f"phalanx plan: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        _check(args)
        for flag, given in (("--state-bits", args.state_bits != 32), ("--batch-per-gpu", args.batch_per_gpu is not None)):
            if given:
                raise ValueError(f"{flag} is priced for --hardware plans only; add --hardware NAME --gpus N "
                                 "--model NAME, or leave it out")
        if args.model and ":" not in args.model and args.model in _workload_names():
            raise ValueError(f"--model {args.model}: a named workload needs --hardware NAME and --gpus N "
                             f"(e.g. phalanx plan --hardware h100-ib400 --gpus 64 --model {args.model})")
        params, tensor_bytes = _model_sizes(args.model) if args.model else (args.params, ())
        if args.model and not params:
            raise ValueError(f"--model {args.model}: the model has no trainable parameters")
        if not params:
            raise ValueError("give --params N or --model MODULE:FACTORY")
        cluster = cost.Cluster(
            hosts=args.hosts, ranks_per_host=args.ranks_per_host,
            intra=cost.Link.from_bandwidth(args.intra_gbps * 1e9 / 8, args.intra_latency_us * 1e-6),
            inter=cost.Link.from_bandwidth(args.inter_gbps * 1e9 / 8, args.inter_latency_us * 1e-6),
            memory_bytes=args.memory_gb * 2**30, overlap=args.overlap,
        )
        moe = dict(num_experts=args.experts, expert_params=args.expert_params,
                   moe_layers=args.moe_layers or args.layers, top_k=args.top_k) if args.experts else {}
        spec = plan.ModelSpec(params=params, layers=args.layers, compute_s=args.compute_ms / 1e3,
                              act_bytes_per_layer=args.act_mb * 1e6, tensor_bytes=tensor_bytes, **moe)
        ranked = plan.search(spec, cluster)
    except (ValueError, ImportError, AttributeError) as err:
        print(f"phalanx plan: {err}", file=sys.stderr)
        return 2
    print(f"phalanx plan: {params / 1e6:.1f}M params, {cluster.hosts} host(s) x {cluster.ranks_per_host} rank(s), "
          f"{len(ranked)} layouts fit; top {args.top}:")
    for i, p in enumerate(ranked[: args.top], start=1):
        print(f"{i:>2}. {p.step_s * 1e3:9.2f} ms  {p.layout}")
        print(f"      why: {p.why}")
    return 0
