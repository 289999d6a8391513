"""ZeRO memory on the GPU: max_memory_allocated per rank, stages 1-3, vs the formula and vs FSDP2.

Issue: "ZeRO memory: torch.cuda.max_memory_allocated per rank, stages 1-3, 2 gloo ranks sharing
the GPU, against the ZeRO formula and against FSDP2 on the same model."

Run:
    python benchmarks/gpu/zero_memory.py --device cuda --out results.jsonl   # ~30-60 s on an H100
    python benchmarks/gpu/zero_memory.py --device cpu --out /tmp/z.jsonl     # dry run, tiny model

Model: ``--layers`` x ``Linear(width, width)`` with ReLU between (default 12 x 4096: Psi = 201.4M
parameters), AdamW, per-rank batch ``--batch`` rows (default 4096), MSE loss on random data,
``--steps`` steps (default 3). Every configuration runs in 2 fresh ranks
(``px.run(np=2, env={"PHALANX_BACKEND": "gloo", "PHALANX_DEVICE": "cuda:0"})``: both ranks on one
GPU, gloo, since NCCL refuses two ranks on one device):

* ``ddp``: torch DDP (``gradient_as_bucket_view=True``), fp32 parameters, ``torch.autocast`` bf16,
  AdamW: the unsharded reference. Formula (docs/zero.md, fp32 row): 4Psi + 4Psi + 8Psi, plus
  autocast's bf16 weight copies (2Psi, held from forward to the end of backward).
* ``zero1`` / ``zero2`` / ``zero3``: ``px.zero(model, AdamW, stage=s, mixed_precision="bf16")``.
  Formula (docs/zero.md, mixed precision, K = 12, N = 2): 2Psi + 2Psi + 12Psi/N,
  2Psi + (2 + 12)Psi/N, (2 + 2 + 12)Psi/N.
* ``fsdp2``: ``fully_shard`` on every Linear and on the root,
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, AdamW. Formula: fp32
  sharded parameters, gradients and AdamW state, (4 + 4 + 8)Psi/N. First tried on the same 2 gloo
  ranks; if that raises (gloo may lack FSDP2's collectives on CUDA tensors), FSDP2 runs in one
  process on torch's fake process group (``init_process_group("fake", world_size=2)``: the
  collectives do nothing, memory is allocated as for rank 0 of 2; how torchtitan estimates
  memory). ``fsdp2_method`` says which. ``--fsdp both`` runs both.

Per (config, rank), one JSON line, step "zero_memory":

* ``max_memory_allocated``: ``torch.cuda.max_memory_allocated()`` over the training steps (peak
  reset after the model was built and wrapped, so it counts the states held then and everything
  the steps add); per step, ``peak_fwd_bwd`` (zero_grad, forward, backward) and
  ``peak_optimizer_step`` (``opt.step()``: AdamW's foreach temporaries on CUDA show here);
  ``peak_build``: the peak while building and wrapping; ``allocated_after_steps``.
* ``memory_report``: ``px.memory_report(opt)`` (ZeRO, DDP's plain optimizer); for FSDP2 the same
  fields computed from the local shards (``memory_report`` counts a DTensor's global size).
  ``states_bytes`` = params + grads + optimizer_state of that report.
* ``formula_states_bytes`` (and its parts), ``ratio_states_formula`` = states_bytes / formula.
* ``activation_bytes``: the same model in bf16 without any wrapper, one forward: the bytes of the
  tensors autograd saved for backward (``saved_tensors_hooks``, parameters excluded), and on CUDA
  the allocation it left (``activation_alloc_bytes``). ``inputs_bytes``: the fp32 batch and target.
* ``formula_bytes`` = formula states + activation_bytes + inputs_bytes (+ autocast copies for
  ddp); ``ratio_peak_formula`` = max_memory_allocated / formula_bytes (what remains above 1:
  the temporaries of backward, communication buffers, gathered units, optimizer temporaries).

``--device cpu`` (dry run): 4 x Linear(64, 64), 1 step, gloo on CPU; max_memory_allocated is
"n/a on cpu" (``memory_report``'s peak there is the process's peak RSS); both FSDP2 methods run,
so the fake-process-group path is checked on CPU tensors. A configuration that raises gets a JSON
line with its error and the run goes on.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_device, emit, parser  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.profiler.memory import peak_bytes  # noqa: E402

STEP = "zero_memory"
NA_CPU = "n/a on cpu"
CONFIGS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


# ----------------------------------------------------------------------------- model and data
def _model(spec: dict, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(spec["layers"]):
        mods += [
            torch.nn.Linear(spec["width"], spec["width"], device=device, dtype=dtype),
            torch.nn.ReLU(),
        ]
    return torch.nn.Sequential(*mods[:-1])


def _batch(spec: dict, device: torch.device, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    shape = (spec["batch"], spec["width"])
    x = torch.randn(shape, generator=g, device=device)
    y = torch.randn(shape, generator=g, device=device)
    return x, y


def psi_of(spec: dict) -> int:
    return spec["layers"] * (spec["width"] * spec["width"] + spec["width"])


def formula_states(config: str, psi: int, n: int) -> dict[str, float]:
    """docs/zero.md's per-rank bytes (AdamW: K = 12 with a separate fp32 master, 8 where the master is the
    parameter: ZeRO-3 and FSDP2)."""
    if config == "ddp":
        return {"params": 4 * psi, "grads": 4 * psi, "optimizer_state": 8 * psi}
    if config == "zero1":
        return {"params": 2 * psi, "grads": 2 * psi, "optimizer_state": 12 * psi / n}
    if config == "zero2":
        return {"params": 2 * psi, "grads": 2 * psi / n, "optimizer_state": 12 * psi / n}
    if config == "zero3":  # the fp32 shard is the parameter, the gradient shard fp32: FSDP2's layout
        return {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer_state": 8 * psi / n}
    if config == "fsdp2":
        return {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer_state": 8 * psi / n}
    raise ValueError(config)


# ----------------------------------------------------------------------------- measurements
def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _fresh(device: torch.device) -> None:
    gc.collect()
    if _cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def activation_bytes(spec: dict, device: torch.device) -> dict:
    """One forward of the plain bf16 model: bytes autograd saved for backward (parameters, batch
    and target excluded, shared storages once) and, on CUDA, the allocation the graph holds."""
    model = _model(spec, device, torch.bfloat16)
    x, y = _batch(spec, device, 0)
    xb = x.to(torch.bfloat16)
    # parameters, the batch and the target are counted elsewhere (states, inputs_bytes)
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    _fresh(device)
    before = torch.cuda.memory_allocated(device) if _cuda(device) else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(xb)
        loss = torch.nn.functional.mse_loss(out.float(), y)
    held = torch.cuda.memory_allocated(device) - before if _cuda(device) else None
    del loss, out, model, x, y, xb
    _fresh(device)
    return {"activation_bytes": sum(saved.values()), "activation_alloc_bytes": held}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def fsdp2_report(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """memory_report's fields from FSDP2's local shards (its DTensors' numel is the global one)."""
    params = list(model.parameters())
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(
            _nbytes(v)
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ),
    }


def _fsdp2_wrap(model: torch.nn.Module, device: torch.device, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def measure(config: str, spec: dict, device: torch.device, rank: int, world: int) -> dict:
    """Build, wrap and train ``config`` for ``spec["steps"]`` steps; the memory it took."""
    act = activation_bytes(spec, device)
    cuda = _cuda(device)
    x, y = _batch(spec, device, rank)
    _fresh(device)
    start_alloc = torch.cuda.memory_allocated(device) if cuda else None
    model = _model(spec, device)
    autocast = False
    if config == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        autocast = True
    elif config.startswith("zero"):
        model, opt = px.zero(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            stage=int(config[-1]),
            mixed_precision="bf16",
        )
    elif config == "fsdp2":
        _fsdp2_wrap(model, device, world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        raise ValueError(f"unknown config {config!r}")
    row: dict = {"allocated_start": start_alloc}
    if cuda:
        torch.cuda.synchronize(device)
        row["peak_build"] = torch.cuda.max_memory_allocated(device)
        row["allocated_after_wrap"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    peak_fb, peak_opt = [], []  # per step: zero_grad + forward + backward, then opt.step()

    def phase_peak(into: list) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            into.append(torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)

    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        del out
        phase_peak(peak_fb)
        opt.step()
        phase_peak(peak_opt)
    row["steps_s"] = time.perf_counter() - t0
    loss_value = float(loss.detach())
    row["loss"] = (
        loss_value if loss_value == loss_value and abs(loss_value) != float("inf") else None
    )  # fake pg: garbage
    if cuda:
        row["max_memory_allocated"] = max(peak_fb + peak_opt)
        row["peak_fwd_bwd"] = peak_fb
        row["peak_optimizer_step"] = peak_opt
        row["allocated_after_steps"] = torch.cuda.memory_allocated(device)
        row["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    else:
        row["max_memory_allocated"] = NA_CPU
    if config == "fsdp2":
        rep = fsdp2_report(model, opt)
        rep["peak"] = peak_bytes(device)
    else:
        rep = px.memory_report(opt)
    row["memory_report"] = rep
    row["states_bytes"] = rep["params"] + rep["grads"] + rep["optimizer_state"]
    row.update(act)
    row["inputs_bytes"] = x.numel() * x.element_size() + y.numel() * y.element_size()
    return row


# ----------------------------------------------------------------------------- rank entry points
def rank_main(config: str, spec: dict) -> dict:
    """In each of the 2 ranks (phalanx initialised by px.run)."""
    device = px.topology().device
    row = measure(config, spec, device, px.rank(), px.size())
    row.update(
        rank=px.rank(), world=px.size(), backend=px.topology().backend, device_str=str(device)
    )
    return row


def fake_main(spec: dict, device_str: str) -> dict:
    """FSDP2 alone in one process on torch's fake process group (rank 0 of 2)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device(device_str)
    if _cuda(device):
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        row = measure("fsdp2", spec, device, 0, 2)
    finally:
        dist.destroy_process_group()
    row.update(rank=0, world=2, backend="fake", device_str=str(device))
    return row


# ----------------------------------------------------------------------------- driver
def _err_text(err: BaseException) -> tuple[str, str]:
    """(one line: the exception and, for a rank's failure, the rank's own last line; the tail of
    the rank's traceback or of this process's)."""
    text = str(err)
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else ""
    last = lines[-1] if len(lines) > 1 else ""
    msg = f"{type(err).__name__}: {head}" + (f" ... {last}" if last else "")
    return msg[:800], (text if len(lines) > 1 else tb)[-4000:]


def _finish(row: dict, config: str, spec: dict) -> dict:
    psi, n = psi_of(spec), row.get("world", 2)
    parts = formula_states(config, psi, n)
    states = sum(parts.values())
    extra = 2 * psi if config == "ddp" else 0  # autocast's bf16 weight copies
    formula = states + extra + row["activation_bytes"] + row["inputs_bytes"]
    row["formula_states"] = parts
    row["formula_states_bytes"] = states
    row["formula_autocast_copies_bytes"] = extra
    row["formula_bytes"] = formula
    row["ratio_states_formula"] = row["states_bytes"] / states
    peak = row.get("max_memory_allocated")
    row["ratio_peak_formula"] = peak / formula if isinstance(peak, int) else NA_CPU
    return row


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=None, help="Linear layers (default 12; cpu: 4)")
    ap.add_argument("--width", type=int, default=None, help="layer width (default 4096; cpu: 64)")
    ap.add_argument("--batch", type=int, default=None, help="rows per rank (default 4096; cpu: 8)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 3; cpu: 1)")
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma list of " + ",".join(CONFIGS)
    )
    ap.add_argument(
        "--fsdp",
        choices=("auto", "gloo", "fake", "both"),
        default=None,
        help="FSDP2 on the 2 gloo ranks, on the fake process group, gloo then fake if gloo "
        "raised (auto: the cuda default), or both (the cpu default)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per configuration's ranks before they are killed (default 90; cpu: 120)",
    )
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=240.0,
        help="skip the configurations left once the run has taken this long",
    )
    args = ap.parse_args()
    check_device(args.device)
    cpu = args.device == "cpu"
    spec = {
        "layers": args.layers or (4 if cpu else 12),
        "width": args.width or (64 if cpu else 4096),
        "batch": args.batch or (8 if cpu else 4096),
        "steps": args.steps or (1 if cpu else 3),
    }
    fsdp = args.fsdp or ("both" if cpu else "auto")
    timeout = args.timeout or (120.0 if cpu else 90.0)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    dev = "cpu" if cpu else "cuda:0"
    env = {
        "PHALANX_BACKEND": "gloo",
        "PHALANX_DEVICE": dev,
        "PHALANX_TIMEOUT": str(int(timeout * 2 / 3)),
    }
    psi = psi_of(spec)
    common = {
        "model": f"{spec['layers']} x Linear({spec['width']},{spec['width']})",
        "psi": psi,
        "batch_per_rank": spec["batch"],
        "steps": spec["steps"],
        "optimizer": "AdamW",
        "mixed_precision": "bf16",
    }
    print(
        f"zero_memory: {common['model']}, Psi = {psi / 1e6:.1f}M, 2 ranks, {dev}, gloo",
        file=sys.stderr,
    )
    t_start = time.perf_counter()

    def record(config: str, method: str | None, **fields) -> None:
        emit(args.out, STEP, args.device, **common, config=config, fsdp2_method=method, **fields)

    def over_budget(config: str, method: str | None = None) -> bool:
        if time.perf_counter() - t_start <= args.max_seconds:
            return False
        record(config, method, error=f"skipped: the run passed --max-seconds {args.max_seconds:g}")
        return True

    def report(config: str, rows: list[dict], method: str | None) -> None:
        for row in rows:
            record(config, method, **_finish(row, config, spec))

    def failed(config: str, err: BaseException, method: str | None) -> None:
        msg, detail = _err_text(err)
        record(config, method, error=msg, detail=detail)

    for config in configs:
        if config != "fsdp2":
            if over_budget(config):
                continue
            try:
                report(
                    config,
                    px.run(rank_main, np=2, args=(config, spec), env=env, timeout=timeout),
                    None,
                )
            except Exception as err:  # noqa: BLE001 - the GPU run is one shot: report and go on
                failed(config, err, None)
            continue
        gloo_ok = False
        if fsdp in ("auto", "gloo", "both") and not over_budget(config, "gloo"):
            method = "gloo (2 ranks, one GPU)" if not cpu else "gloo (2 ranks, cpu)"
            try:
                report(
                    config,
                    px.run(rank_main, np=2, args=(config, spec), env=env, timeout=timeout),
                    method,
                )
                gloo_ok = True
            except Exception as err:  # noqa: BLE001 - fall back to the fake process group
                failed(config, err, method)
        if (fsdp in ("fake", "both") or (fsdp == "auto" and not gloo_ok)) and not over_budget(
            config, "fake"
        ):
            method = "fake process group (rank 0 of 2, one process)"
            try:
                report(
                    config,
                    px.run(fake_main, np=1, args=(spec, dev), env=env, timeout=timeout, init=False),
                    method,
                )
            except Exception as err:  # noqa: BLE001
                failed(config, err, method)
    print(f"zero_memory: done in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
