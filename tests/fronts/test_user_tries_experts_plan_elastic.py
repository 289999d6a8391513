"""What a user who read docs/model_parallel.md (expert parallel), `phalanx plan --help` and docs/elastic.md
tripped on, each now one line that names the fix (the brief of s7-ux).

Found with scripts of their own under ``phalanx run -np 2|4`` (a small MoE with a DataLoader, ZeRO,
clipping and a checkpoint saved at ep 4 and resumed at ep 2; `phalanx plan` with bad flags; an elastic
job with a discovery script). One process each: the checks run before any collective, and the
checkpoint's fault shows at world 1 already.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.unit


def _moe_net():
    from phalanx.models.moe import MoE

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), MoE(8, 4, 2, capacity_factor=None))


def _adam(params):
    return torch.optim.Adam(params, lr=0.1)


def test_expert_parallel_before_init_and_a_router_of_the_wrong_shape(alone):
    from phalanx.parallel.expert import ExpertParallelError, expert_parallel
    from phalanx.parallel.grid import RankGrid

    # was: "Default process group has not been initialized" from torch's broadcast, three calls down
    with pytest.raises(ExpertParallelError, match=r"expert_parallel: torch.distributed is not initialised; call "
                                                  r"px.init\(\) first"):
        expert_parallel(_moe_net(), RankGrid(), optimizer=_adam)
    moe = _moe_net()[1]
    x = torch.randn(6, 8)
    for experts in (5, 3):  # 5: "size of tensor a (8) must match ... (12)"; 3: expert 3 silently never used
        moe.router = nn.Sequential(nn.Linear(8, experts), nn.Softmax(-1))
        with pytest.raises(ValueError, match=rf"MoE: the router returned shape \(6, {experts}\) for 6 tokens; it must "
                                             r"return \(tokens, num_experts\) = \(6, 4\) probabilities"):
            moe(x)


def test_a_tensor_parallel_plan_naming_a_block_says_to_name_its_layers():
    from phalanx.parallel.tensor import apply_tensor_parallel

    model = nn.Sequential(nn.Linear(2, 4), nn.ModuleDict({"attention": nn.Sequential(nn.Linear(4, 4))}))
    # was: AttributeError: 'Sequential' object has no attribute 'bias' (torchtitan: 'GQAttention' ...)
    with pytest.raises(TypeError, match=r"plan\['1.attention'\] = 'colwise': style 'colwise' applies to nn.Linear "
                                        r"\(or HF's Conv1D\), got Sequential; name the layers inside it"):
        apply_tensor_parallel(model, {"1.attention": "colwise"}, None)


def test_expert_checkpoint_resumes_into_a_fresh_optimizer(alone, tmp_path):
    """A resumed job's optimizer has not stepped: its experts' Adam moments came back as the whole (E, ...)
    stack on every expert, and the first step failed (``output with shape [32, 8] doesn't match the broadcast
    shape [4, 32, 8]``)."""
    import phalanx.checkpoint as ckpt
    from phalanx.parallel.expert import expert_parallel
    from phalanx.parallel.grid import RankGrid

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def build():
            return expert_parallel(_moe_net(), RankGrid(), optimizer=_adam)

        x = torch.randn(16, 4)
        model, opt = build()
        model(x).sum().backward()
        opt.step()
        ckpt.save(str(tmp_path / "c"), {"model": ckpt.ExpertCheckpoint(model, opt), "dense_optim": opt.dense})
        fresh, fresh_opt = build()
        ckpt.load(str(tmp_path / "c"), {"model": ckpt.ExpertCheckpoint(fresh, fresh_opt), "dense_optim": fresh_opt.dense})
        for j in range(4):
            saved, loaded = (o.experts.optimizer.state[m[1].experts[j].fc.weight] for m, o in ((model, opt),
                                                                                               (fresh, fresh_opt)))
            torch.testing.assert_close(loaded["exp_avg"], saved["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(loaded["exp_avg_sq"], saved["exp_avg_sq"], rtol=0, atol=0)
        for m, o in ((model, opt), (fresh, fresh_opt)):  # the next step: the same on both
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        for p, q in zip(model.parameters(), fresh.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


PLAN_MISTAKES = [
    # was: "give --hardware NAME, --gpus N and --model NAME together" (all three were given)
    (["--gpus", "0", "--hardware", "h100-ib400", "--model", "gpt-13b"], "--gpus must be at least 1, got 0"),
    # was: a plan with negative step times (-2) or the default batch, silently (0)
    (["--gpus", "8", "--hardware", "h100-ib400", "--model", "gpt-13b", "--batch-per-gpu", "-2"],
     "--batch-per-gpu must be positive, got -2"),
    (["--gpus", "8", "--hardware", "h100-ib400", "--model", "gpt-13b", "--top", "0"], "--top must be at least 1"),
    (["--gpus", "8", "--hardware", "h100-ib400", "--model", "gpt-13b", "--layers", "0", "--hosts", "2"],
     "--layers, --hosts: the cluster cost model's, unused by a --hardware plan"),
    (["--gpus", "8", "--hardware", "h100-ib400", "--params", "13e9"], "a --hardware plan needs --model NAME too"),
    (["--gpus", "8", "--hardware", "h100-ib400", "--model", "torch.nn:Transformer"],
     "a model of your own (MODULE:FACTORY or --params N) goes without --hardware/--gpus"),
    (["--gpus", "8", "--hardware", "h100-ib400", "--model", "gpt-14b"], "unknown model 'gpt-14b' for a --hardware plan"),
    (["--gpus", "8", "--hardware", "./hw.json", "--model", "gpt-13b"], "takes a profile name, not a file"),
    (["--model", "gpt-13b"], "a named workload needs --hardware NAME and --gpus N"),
    # was: "cpu2 ... has no 'fp16' peak; choose one of ['fp32']", a precision no flag chooses
    (["--gpus", "2", "--hardware", "cpu2", "--model", "gpt-13b"],
     "--model gpt-13b trains in fp16, for which --hardware cpu2 has no peak (it has fp32); choose hardware with fp16"),
    (["--params", "1e9", "--batch-per-gpu", "4"], "--batch-per-gpu is priced for --hardware plans only"),
    (["--params", "1e9", "--experts", "8", "--expert-params", "5e8", "--act-mb", "10", "--top-k", "9"],
     "--top-k 9 must be between 1 and --experts 8"),
    (["--params", "1e9", "--layers", "4", "--moe-layers", "9", "--experts", "8", "--expert-params", "5e8",
      "--act-mb", "10"], "--moe-layers 9 must be between 1 and --layers 4"),
    (["--params", "1e9", "--experts", "8", "--expert-params", "2e9", "--act-mb", "10"],
     "--expert-params 2e+09 is more than --params 1e+09"),
]


def test_plan_refuses_each_mistake_in_one_line(capsys):
    from phalanx.cli import plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    for argv, says in PLAN_MISTAKES:
        args = parser.parse_args(["plan", *argv])
        rc, out = args.func(args), capsys.readouterr()
        assert rc == 2 and out.err.count("\n") == 1 and says in out.err and not out.out, (argv, rc, out)
    args = parser.parse_args(["plan", "--gpus", "8", "--hardware", "h100-ib400", "--model", "gpt-1.3b", "--top", "1",
                              "--batch-per-gpu", "4", "--state-bits", "8"])  # every --hardware flag still taken
    assert args.func(args) == 0 and "global batch 32" in capsys.readouterr().out


def test_a_discovery_script_printing_garbage_is_refused_at_launch_and_said_once_after(tmp_path, monkeypatch):
    from phalanx.launcher import discovery
    from phalanx.launcher.launch_options import add_elastic_arguments, elastic_launch_options

    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'hello world'\necho localhost:2\n")
    script.chmod(0o755)
    p = argparse.ArgumentParser()
    add_elastic_arguments(p)
    # was: 'hello world' taken as a host of one slot; 'localhost:two' a warning every poll, then this machine
    with pytest.raises(ValueError, match=rf"--host-discovery-script {script}: at launch it printed 'hello world'; "
                                         r"print host:slots lines \(e.g. localhost:2\)"):
        elastic_launch_options(p.parse_args(["--min-np", "1", "--host-discovery-script", str(script)]), 2, {})
    said = []
    monkeypatch.setattr(discovery.log, "warning", lambda *a: said.append(a))
    warned: set[str] = set()
    for _ in range(3):  # the supervisor polls every second: one warning, not one a poll
        assert discovery.discover_reachable(str(script), set(), None, timeout_s=10, warned=warned) is None
    assert len(said) == 1 and "printed 'hello world'" in str(said[0][1])
    script.write_text("#!/bin/sh\necho localhost:2\n")
    assert discovery.discover_reachable(str(script), set(), None, timeout_s=10, warned=warned) == {"localhost": 2}
    assert not warned  # said again if it breaks again
