"""The planner recommends only what phalanx builds: every data-parallel choice it can emit comes from
phalanx.parallel.composition, each is built with real px objects in a world of one and trained a
step, and ``phalanx plan`` on the issue's four published-scale cases recommends nothing px refuses."""

import argparse
import json
import re
import subprocess
import sys
import textwrap

import pytest

from phalanx.comm.compression import get_compressor
from phalanx.parallel import composition
from phalanx.planner import cost, plan, scaling

CASES = [(1024, "h100-ib400", "gpt-13b"), (512, "p100-roce25", "resnet101"), (256, "a100-hdr", "gpt-1.3b"),
         (64, "h100-eth25", "resnet50")]


def _runnable() -> set:
    """(strategy, compression, algorithm, model parallel) of every choice the strategies accept."""
    priced = {c: scaling.SUMMABLE[c] for c in scaling.COMPRESSIONS}
    return {(o.axis.name, o.compression, o.algorithm, mp)
            for mp in (False, True) for o in composition.data_axis_options(priced, model_parallel=mp)}


def _shape(job: scaling.Job) -> tuple:
    alg = "flat" if job.zero else job.algorithm
    return job.strategy, job.compression, alg, job.tp > 1 or job.pp > 1


@pytest.mark.unit
def test_the_planners_emit_only_what_the_strategies_accept():
    # the compressors' own word on summability is the one the planners use
    for name, summable in {**scaling.SUMMABLE, **plan.SUMMABLE}.items():
        assert get_compressor(name).summable is summable, name
    runnable = _runnable()
    assert ("zero1", "int8", "flat", False) not in runnable and ("allreduce", "int8", "flat", True) not in runnable
    emitted = set()
    for gpus, hw, model in CASES:
        from phalanx.planner import hardware, workloads

        w = workloads.get(model)
        for p in scaling.search(w, hardware.get(hw), gpus, gpus * scaling.DEFAULT_BATCH_PER_GPU[w.kind]):
            if p.job.dp > 1:
                emitted.add(_shape(p.job))
            assert p.job.command().split("(")[0] in ("px.DataParallel", "px.zero", "px.parallelize",
                                                     "plain model ")
    assert emitted <= runnable, emitted - runnable
    assert {s[0] for s in emitted} == {"allreduce", "zero1", "zero2", "zero3"}  # the search reaches them all
    # the measured-model planner (phalanx plan --params): the same rule
    cl = cost.Cluster(hosts=2, ranks_per_host=4, intra=cost.Link.from_bandwidth(10e9, 5e-6),
                      inter=cost.Link.from_bandwidth(125e6, 5e-5))
    spec = plan.ModelSpec(params=100e6, layers=8, compute_s=0.5, act_bytes_per_layer=1e6)
    for p in plan.search(spec, cl):
        lay = p.layout
        if lay.dp > 1:
            name = f"zero{lay.zero}" if lay.zero else "allreduce"
            assert (name, lay.compression, "flat", lay.tp > 1 or lay.pp > 1) in runnable | {
                (name, "bf16", "flat", False)}, lay


BUILD = textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    import phalanx as px
    from phalanx.models import GPT, GPTConfig, gpt_tp_plan
    from phalanx.parallel import composition
    from phalanx.parallel.grid import RankGrid

    px.init()
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))

    for name, comp, alg, model_parallel in json.loads(sys.argv[1]):
        torch.manual_seed(0)
        model, zero = GPT(cfg), composition.by_name(name).zero
        adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
        if model_parallel:   # what parallelize builds (tp, pp > 1), on a mesh of one, 2 micro-batches
            pm = px.parallelize(model, px.RankGrid(dp=1, pp=1, tp=1), loss_fn=loss_fn, tp_plan=gpt_tp_plan(model),
                                num_microbatches=2, data_parallel=name, optimizer=adamw)
            loss = pm.step(x, y)
            pm.optimizer.step()
            if zero:          # and ZeRO as parallelize calls it on the dp group
                torch.manual_seed(0)
                other = GPT(cfg)
                m, opt = px.zero(other, adamw(other.parameters()), stage=zero, backward_passes_per_step=2)
                loss_fn(m(x), y).backward()
                opt.step()
        else:
            compression = None if comp == "none" else comp
            if zero:
                m, opt = px.zero(model, adamw(model.parameters()), stage=zero, compression=compression)
            else:
                m, opt = px.DataParallel(model, compression=compression, algorithm=alg), adamw(model.parameters())
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
        assert torch.isfinite(loss), (name, comp, alg)
        print("BUILT", name, comp, alg, model_parallel, flush=True)
""")


@pytest.mark.ranks
def test_every_runnable_choice_builds_and_steps_in_a_world_of_one():
    shapes = sorted(_runnable())
    out = subprocess.run([sys.executable, "-c", BUILD, json.dumps(shapes)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    built = [line for line in out.stdout.splitlines() if line.startswith("BUILT")]
    assert len(built) == len(shapes), out.stdout


@pytest.mark.unit
@pytest.mark.parametrize("gpus,hw,model", CASES, ids=[c[2] for c in CASES])
def test_plan_command_recommends_nothing_phalanx_refuses(gpus, hw, model, capsys):
    from phalanx.cli import plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--gpus", str(gpus), "--hardware", hw, "--model", model, "--top", "10"])
    assert args.func(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s*\d+\s+[\d.]+\s", line)]
    assert len(rows) == 10
    for row in rows:
        layout = row.split("  ")[-1]
        tp, pp = (int(re.search(rf"{k}=(\d+)", layout).group(1)) for k in ("tp", "pp"))
        lossy = re.search(r"\b(int8|powersgd)\b", layout)
        assert not (lossy and "zero=" in layout), f"px.zero refuses {lossy.group(1)}: {row}"
        if tp > 1 or pp > 1:
            assert not lossy and "fp16" not in layout and "hierarchical" not in layout, row
