"""Mesh groups and errors (no ranks), and parallelize() on 4 real ranks for dp × pp × tp combinations
against one process: same loss per step and same parameters after 10 steps."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import GPT, GPTConfig, gpt_tp_plan
from phalanx.parallel.grid import GridError, RankGrid
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
STEPS, BATCH = 10, 8


def test_mesh_groups_and_order():
    mesh = RankGrid(dp=2, pp=2, tp=2, world_size=8, rank=5)
    assert mesh.coord == (1, 0, 1)
    assert list(mesh.groups("tp")) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp innermost: neighbours
    assert list(mesh.groups("pp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert list(mesh.groups("dp")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (mesh.tp_ranks, mesh.pp_ranks, mesh.dp_ranks) == ([4, 5], [5, 7], [1, 5])
    every = sorted(r for dim in ("dp", "pp", "tp") for g in mesh.groups(dim) for r in g)
    assert every == sorted(list(range(8)) * 3)  # each rank in exactly one group per dim


def test_parallelize_rejects_bad_data_parallel_choices():
    from phalanx.parallel.parallelize import parallelize

    mesh = RankGrid(world_size=1)
    with pytest.raises(ValueError, match="data_parallel='zero4'"):
        parallelize(_gpt(), mesh, loss_fn=F.cross_entropy, data_parallel="zero4")
    with pytest.raises(ValueError, match="pass optimizer="):
        parallelize(_gpt(), mesh, loss_fn=F.cross_entropy, data_parallel="zero1")
    with pytest.raises(ValueError, match="interleaved schedule"):
        parallelize(_gpt(), RankGrid(dp=2, world_size=2, rank=0), loss_fn=F.cross_entropy,
                    schedule="interleaved_1f1b", data_parallel="zero1", optimizer=torch.optim.SGD)


def test_mesh_error_names_every_factor():
    with pytest.raises(GridError, match=r"dp=2 × pp=3 × tp=2 = 12, but the world size is 8"):
        RankGrid(dp=2, pp=3, tp=2, world_size=8)
    with pytest.raises(GridError, match="tp=0"):
        RankGrid(dp=1, pp=1, tp=0, world_size=1)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch(step):
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _combos(combos):
    import phalanx as px
    from phalanx.parallel.parallelize import parallelize
    from phalanx.parallel.tensor import gather_tp_state_dict, vocab_parallel_cross_entropy

    results = {}
    for dp, pp, tp, m, schedule, dp_impl in combos:
        mesh = RankGrid(dp=dp, pp=pp, tp=tp)
        model = _gpt()

        def loss_fn(logits, y, group=mesh.tp_group):
            return vocab_parallel_cross_entropy(logits, y, group)

        pm = parallelize(model, mesh, loss_fn=loss_fn, tp_plan=gpt_tp_plan(model) if tp > 1 else None,
                         num_microbatches=m, schedule=schedule, partition_method="uniform",
                         data_parallel=dp_impl, optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
        opt = pm.optimizer
        d = mesh.coord[0]
        losses = []
        for step in range(STEPS):
            x, y = _batch(step)
            rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)  # this replica's share
            losses.append(pm.step(x[rows], y[rows]).item())
            opt.step()
            opt.zero_grad()
        if pp > 1:  # gradients travel on the mesh's second pipeline group, activations on the first
            assert all(link.grad_group is mesh.pp_grad_group and link.group is mesh.pp_group
                       and mesh.pp_grad_group is not mesh.pp_group for link in pm.stage.links)
        results[(dp, pp, tp, m, schedule, dp_impl)] = (px.rank(), losses, gather_tp_state_dict(pm.module, mesh.tp_group))
    return results


def _reference():
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, CFG.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def test_dp_pp_tp_combinations_on_4_ranks_match_one_process():
    # (dp, pp, tp, micro-batches, schedule, data-parallel implementation); ZeRO 1/2/3 on the dp axis
    # of pp and tp meshes (the 3D combination with ZeRO)
    combos = [(1, 2, 2, 4, "1f1b", "auto"), (2, 2, 1, 2, "gpipe", "auto"), (2, 1, 2, 2, "1f1b", "auto"),
              (1, 4, 1, 4, "gpipe", "auto"), (4, 1, 1, 1, "1f1b", "auto"), (2, 2, 1, 4, "1f1b", "allreduce"),
              (2, 2, 1, 4, "1f1b", "zero1"), (2, 1, 2, 2, "1f1b", "zero2"), (2, 2, 1, 4, "1f1b", "zero3"),
              (1, 2, 2, 4, "interleaved_1f1b", "auto"), (2, 2, 1, 2, "interleaved_1f1b", "auto")]
    results = distributed(_combos, np=4, args=(combos,), timeout=240)
    ref_losses, ref_params = _reference()
    for combo in combos:
        merged = {}
        for res in results:
            _, losses, params = res[combo]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0,
                                       msg=lambda m, c=combo: f"{c} losses: {m}")
            for k, v in params.items():
                if k in merged:  # dp replicas and tp peers must agree on what they both hold
                    torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=0)
                merged[k] = v
        assert merged.keys() == ref_params.keys(), combo
        for k, v in ref_params.items():
            torch.testing.assert_close(merged[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k, c=combo: f"{c} {k}: {m}")
