"""A head tied across pipeline stages under ZeRO: the copy's optimizer state on every holder vs its first only;
and (``--pp 4``) what the stages between the copies move for them.

Run:  px-bench python benchmarks/tied_state.py [--before 5ad5455] [--vocab 50257] [--embd 256] [--layers 4]
          [--stages 2,3] [--state-bits 32,8] [--steps 6] [--dp 2] [--pp 2]
      px-bench python benchmarks/tied_state.py --before 4f75307 --dp 1,2 --pp 4 --state-bits 32

Hugging Face GPT-2 (random weights, the head tied to the embedding), ``parallelize`` over dp 2 x pp 2
with ZeRO-2 (``data_parallel="zero2"``), Adam; 4 gloo ranks, one global batch of 4 sequences of 64.
The same job runs twice in one invocation: with phalanx as it was at ``--before`` (``git archive`` of
that commit into a temporary folder: every stage holding a copy kept its Adam moments and stepped it,
the copies' gradient shards all-reduced over the pipeline) and with this tree (only the first holder
keeps the moments and steps the copy; the others get the stepped master slice by broadcast,
:mod:`phalanx.parallel.zero.tied`). Per stage: bytes of optimizer state on its dp rank 0 (every tensor
in ``opt.state``), and the step time (median of the steps after the first, rank 0's wall clock:
``pm.step`` plus ``optimizer.step``). Printed side by side with the ratio.

``--dp`` / ``--pp`` set the layout (dp x pp ranks; ``--dp 1,2`` runs each). With ``--pp 4`` the copies
sit on stages 0 and 3 and stages 1 and 2 hold none: ``tied B/step`` is the bytes of the tensors a rank
hands to collectives for the tied copies in one step (every ``dist.all_reduce`` / ``reduce`` /
``broadcast`` called from phalanx's tied-copy code: ZeRO's ``reduce_grad_shards`` / ``send_updated``,
the pipeline's ``_sum_tied_grads``; counted after the first step, averaged). At dp 1 ``parallelize``
uses no ZeRO and the pipeline sums the copies' ``.grad``; at dp 2 ZeRO does. Up to 4f75307
both ran over the whole pipeline group, a middle stage sending zeros; now, over a group
of the holders (:func:`phalanx.parallel.pipeline.holder_groups`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SEQ, ROWS = 64, 4


_TIED_CALLERS = {"reduce_grad_shards", "send_updated", "_sum_tied_grads"}


def _count_tied_bytes(counter: list) -> None:
    """Wrap dist.all_reduce / reduce / broadcast: add the tensor's bytes to counter[0] when a caller up
    the stack is phalanx's tied-copy code (the per-step sums and sends, not the first step's sync)."""
    import torch.distributed as dist

    for name in ("all_reduce", "reduce", "broadcast"):
        inner = getattr(dist, name)

        def wrapped(tensor, *a, _inner=inner, **k):
            f = sys._getframe(1)
            for _ in range(8):
                if f is None:
                    break
                if f.f_code.co_name in _TIED_CALLERS:
                    counter[0] += tensor.numel() * tensor.element_size()
                    break
                f = f.f_back
            return _inner(tensor, *a, **k)

        setattr(dist, name, wrapped)


def _job(vocab, embd, layers, stage, bits, steps, dp=2, pp=2):
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    import phalanx as px
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import parallelize

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=embd, n_layer=layers,
                                       n_head=max(1, embd // 64), tie_word_embeddings=True))
    counter = [0]
    _count_tied_bytes(counter)
    mesh = RankGrid(dp=dp, pp=pp)
    pm = parallelize(model, mesh, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                     num_microbatches=2, data_parallel=f"zero{stage}",
                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                     zero_options={"state_bits": bits} if dp > 1 else None)  # dp 1: no ZeRO (refuses options)
    d = mesh.coord[0]
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
        x, y = ids[:, :-1].chunk(dp)[d], ids[:, 1:].chunk(dp)[d]
        dist.barrier()
        if step == 1:
            counter[0] = 0
        t = time.perf_counter()
        pm.optimizer.zero_grad()
        pm.step(x, y)
        pm.optimizer.step()
        times.append(time.perf_counter() - t)
    state = sum(v.numel() * v.element_size() for st in pm.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v))
    held = [t for t in pm.module.tied_across_stages if t.param is not None]
    return {"rank": px.rank(), "coord": mesh.coord, "state": state, "step_s": statistics.median(times[1:]),
            "tied_bytes": counter[0] / max(1, steps - 1),
            "copy_elems": sum(t.param.numel() for t in held), "phalanx": os.path.dirname(os.path.dirname(px.__file__))}


def _one(args, variant: str) -> None:
    """In a subprocess whose PYTHONPATH is the tree under test: the job, printed as one line per stage."""
    import phalanx as px

    dp, pp = int(args.dp), int(args.pp)
    res = px.run(_job, np=dp * pp, args=(args.vocab, args.embd, args.layers, args.stage, args.bits, args.steps, dp, pp),
                 env={"PHALANX_BACKEND": "gloo"}, timeout=args.timeout)
    for r in res:
        if r["coord"][0] == 0:
            print(f"RESULT {variant} stage{r['coord'][1]} {r['state']} {r['step_s']:.4f} {r['copy_elems']} "
                  f"{r['tied_bytes']:.0f} {r['phalanx']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="5ad5455", help="the commit whose phalanx keeps a copy's state on every holder")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", default="2", help="ZeRO stages, comma-separated")
    ap.add_argument("--state-bits", default="32,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--dp", default="2", help="dp sizes, comma-separated (dp x pp ranks each)")
    ap.add_argument("--pp", default="2", help="pp sizes, comma-separated")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant here
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--bits", type=int, default=32, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        _one(a, a.one)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"GPT-2 tied, vocab {a.vocab}, n_embd {a.embd}, {a.layers} layers, dp {a.dp} x pp {a.pp}, {a.steps} steps, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; before = {a.before}")
    print("| dp x pp | ZeRO | state | stage | state MiB before | after | after/before | step s before | after | "
          "after/before | tied B/step before | after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as old:
        tar = subprocess.run(["git", "-C", here, "archive", a.before, "phalanx"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=tar, check=True)
        layouts = [(dp, pp) for pp in a.pp.split(",") for dp in a.dp.split(",")]
        for (dp, pp), stage, bits in ((lay, int(st), int(b)) for lay in layouts for st in a.stages.split(",")
                                      for b in a.state_bits.split(",")):
            rows = {}
            for variant, tree in (("before", old), ("after", here)):
                env = {**os.environ, "PYTHONPATH": tree}
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", variant, "--stage",
                                      str(stage), "--bits", str(bits), "--vocab", str(a.vocab), "--embd",
                                      str(a.embd), "--layers", str(a.layers), "--steps", str(a.steps),
                                      "--timeout", str(a.timeout), "--dp", dp, "--pp", pp], env=env, cwd=tree,
                                     capture_output=True, text=True)  # cwd: the forkserver's '' on sys.path
                lines = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
                if not lines:
                    print(f"{variant}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
                for _, v, st, state, t, copy, moved, tree in lines:
                    rows[(v, st)] = (int(state), float(t), float(moved))
                    print(f"  {v} {st}: phalanx from {tree}, a tied copy of {int(copy)} elements here", flush=True)
            zero = f"{stage}" if int(dp) > 1 else "none (dp 1: the pipeline sums .grad)"
            for st in sorted({k[1] for k in rows}):
                (b_s, b_t, b_m), (a_s, a_t, a_m) = (rows.get((v, st), (0, 0.0, 0.0)) for v in ("before", "after"))
                print(f"| {dp} x {pp} | {zero} | {bits}-bit | {st} | {b_s / 2**20:.2f} | {a_s / 2**20:.2f} | "
                      f"{a_s / b_s if b_s else 0:.2f}x | {b_t:.3f} | {a_t:.3f} | {a_t / b_t if b_t else 0:.2f}x | "
                      f"{b_m:.0f} | {a_m:.0f} |", flush=True)


if __name__ == "__main__":
    main()
