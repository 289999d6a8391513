"""Expert parallel (MoE over an ep axis) on real gloo ranks against one process.

One spawned group of 4 ranks trains every case (dp × ep meshes with plain data
parallel and ZeRO, k = 1 and 2, dropping and no-drop, phalanx's GPT with MoE
blocks, dp × pp × ep and tp × ep through ``parallelize``, a transformers Mixtral),
saves an expert-sharded checkpoint at ep = 4 and loads it at dp 2 × ep 2. The reference is one
process running the same model on each rank's slice of the batch in turn (the
capacity counts one forward's tokens, so the slices are the routing groups),
accumulating ``loss / W`` — the gradient of the global mean loss. Each check is its
own test; the mistakes a user can make are checked without ranks.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models import GPT, GPTConfig
from phalanx.models.moe import MoE
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

STEPS, BATCH, DIM, EXPERTS = 4, 8, 8, 4
TOL = 1e-5
GPT_CFG = dict(vocab_size=16, block_size=6, n_layer=2, n_head=2, n_embd=8, n_experts=EXPERTS)

# name: (model, dp, ep, top_k, capacity_factor, data_parallel, optimizer)
CASES = {
    "ep4_top1_drop_sgd": ("mlp", 1, 4, 1, 1.0, "allreduce", "sgd"),
    "ep4_top2_nodrop_adam": ("mlp", 1, 4, 2, None, "allreduce", "adam"),
    "dp2_ep2_top2_drop_adam": ("mlp", 2, 2, 2, 1.0, "allreduce", "adam"),
    "dp2_ep2_zero1_adam": ("mlp", 2, 2, 2, 1.25, "zero1", "adam"),
    "dp2_ep2_zero2_adam": ("mlp", 2, 2, 1, 1.25, "zero2", "adam"),
    "gpt_dp2_ep2_sgd": ("gpt", 2, 2, 2, 1.0, "allreduce", "sgd"),  # Adam turns the key bias's zero gradient into noise
}
PIPELINE = "gpt_pp2_ep2_m2"  # parallelize(dp=1, pp=2, ep=2), two micro-batches, SGD
# clipped by the whole model's norm at CLIP, below every step's one-process norm (the tests check it):
# expert_parallel(max_grad_norm=) over dp 2 x ep 2 (all-reduce, ZeRO-2), pm.clip_grad_norm_ over pp 2 x ep 2
CLIP = 0.3
CLIPPED = ("dp2_ep2_top2_drop_adam", "dp2_ep2_zero2_adam")
TENSOR = "gpt_tp2_ep2"  # parallelize(tp=2, ep=2): experts whole on each tp rank, cut over ep


def _mlp(top_k, cap):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, DIM), MoE(DIM, EXPERTS, top_k, capacity_factor=cap, hidden=12),
                         nn.Linear(DIM, 3))


def _gpt(top_k, cap):
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_CFG, moe_top_k=top_k, capacity_factor=cap))


def _model(kind, top_k, cap):
    return (_mlp if kind == "mlp" else _gpt)(top_k, cap)


def _batch(kind, step, slices):
    """The global batch of ``step``, cut in ``slices`` (one per rank's batch index)."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    else:
        ids = torch.randint(0, GPT_CFG["vocab_size"], (BATCH, GPT_CFG["block_size"] + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
    return list(zip(x.chunk(slices), y.chunk(slices)))


def _loss(kind, out, y):
    return F.mse_loss(out, y) if kind == "mlp" else F.cross_entropy(out.flatten(0, 1), y.flatten())


def _opt(name):
    return (lambda ps: torch.optim.SGD(ps, lr=0.2)) if name == "sgd" else (lambda ps: torch.optim.Adam(ps, lr=0.02))


def _moes(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def _global_state(model):
    """The model's state with every local expert under its global index."""
    out = dict(model.state_dict())
    for path, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        for j in range(len(moe.experts)):
            local, full = f"{path}.experts.{j}.", f"{path}.experts.{j + moe.expert_offset}."
            for k in [k for k in out if k.startswith(local)]:
                out["@" + full + k[len(local):]] = out.pop(k)
    return {k.lstrip("@"): v.detach().clone() for k, v in out.items()}


def _reference(kind, top_k, cap, opt_name, slices, micro=1, clip=None, norms=None):
    """One process: each slice (and micro-batch) forward in turn, loss / (slices · micro); with ``clip``,
    torch's ``clip_grad_norm_`` before each step (its norms appended to ``norms``)."""
    model = _model(kind, top_k, cap)
    for moe in _moes(model):
        moe.aux_grad_scale = 1.0 / (slices * micro)
    opt = _opt(opt_name)(model.parameters())
    losses, dropped, aux = [], [], []
    for step in range(STEPS):
        step_losses, step_dropped, step_aux = [], [], []
        for x, y in _batch(kind, step, slices):
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                loss = _loss(kind, model(xm), ym)
                (loss / (slices * micro)).backward()
                step_losses.append(loss.item())
                step_dropped.append([m.last_dropped for m in _moes(model)])
                step_aux.append([m.last_aux_loss.item() for m in _moes(model)])
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
        dropped.append(step_dropped)
        aux.append(step_aux)
    return losses, dropped, aux, _global_state(model)


def _train(name, clip=None, norms=None):
    """In a rank: one case of CASES; this rank's losses, drops, balance losses and state."""
    from phalanx.parallel.expert import expert_parallel
    from phalanx.parallel.grid import RankGrid

    kind, dp, ep, top_k, cap, dp_impl, opt_name = CASES[name]
    mesh = RankGrid(dp=dp, ep=ep)
    model, opt = expert_parallel(_model(kind, top_k, cap), mesh, optimizer=_opt(opt_name), data_parallel=dp_impl,
                                 max_grad_norm=clip)
    losses, dropped, aux = [], [], []
    for step in range(STEPS):
        x, y = _batch(kind, step, dp * ep)[mesh.batch_index]
        loss = _loss(kind, model(x), y)
        loss.backward()
        norm = opt.step()
        if clip is not None:
            norms.append(float(norm))
        opt.zero_grad()
        losses.append(loss.item())
        dropped.append([m.last_dropped for m in _moes(model)])
        aux.append([m.last_aux_loss.item() for m in _moes(model)])
    return mesh.batch_index, losses, dropped, aux, _global_state(model), (model, opt)


def _pipeline(clip=None, norms=None):
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import parallelize

    mesh = RankGrid(dp=1, pp=2, ep=2)
    pm = parallelize(_gpt(2, 1.0), mesh, loss_fn=lambda out, y: _loss("gpt", out, y), num_microbatches=2,
                     partition_method="uniform", data_parallel="allreduce", optimizer=_opt("sgd"))
    losses = []
    for step in range(STEPS):
        x, y = _batch("gpt", step, 2)[mesh.batch_index]
        losses.append(pm.step(x, y).item())
        if clip is not None:
            norms.append(pm.clip_grad_norm_(clip).item())
        pm.optimizer.step()
        pm.optimizer.zero_grad()
    return mesh.batch_index, losses, _global_state(pm.module)


def _tensor():
    from phalanx.models import gpt_tp_plan
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import parallelize
    from phalanx.parallel.tensor import gather_tp_state_dict, vocab_parallel_cross_entropy

    mesh = RankGrid(tp=2, ep=2)
    model = _gpt(2, 1.0)
    pm = parallelize(model, mesh, loss_fn=lambda out, y: vocab_parallel_cross_entropy(out, y, mesh.tp_group),
                     tp_plan=gpt_tp_plan(model), data_parallel="allreduce", optimizer=_opt("sgd"))
    losses = []
    for step in range(STEPS):
        x, y = _batch("gpt", step, 2)[mesh.batch_index]
        losses.append(pm.step(x, y).item())
        pm.optimizer.step()
        pm.optimizer.zero_grad()
    experts = _global_state(pm.module)
    state = {k: v for k, v in gather_tp_state_dict(pm.module, mesh.tp_group).items() if ".experts." not in k}
    return losses, state | {k: v for k, v in experts.items() if ".experts." in k}


def _four_ranks(ckpt_dir):
    import phalanx.checkpoint as ckpt
    from phalanx.parallel.expert import AllToAllDispatch, expert_parallel
    from phalanx.parallel.grid import RankGrid

    out = {}
    for name in CASES:
        *result, (model, opt) = _train(name)
        out[name] = tuple(result)
        if name == "ep4_top2_nodrop_adam":  # saved at ep = 4, loaded at ep = 2 by the next group
            ckpt.save(ckpt_dir, {"model": ckpt.ExpertCheckpoint(model, opt), "dense_optim": opt.dense})
            out["saved"] = _global_state(model)
            out["saved_optim"] = {k: v for k, v in ckpt.ExpertCheckpoint(model, opt).state_dict()["optim"].items()}
            splits = [m.dispatcher.last_splits for m in _moes(model)]
            out["splits"] = splits, all(isinstance(m.dispatcher, AllToAllDispatch) for m in _moes(model))
    out[PIPELINE] = _pipeline()
    for name in CLIPPED:  # clipped by the whole model's norm: (this rank's result, its norms)
        norms = []
        *result, _ = _train(name, CLIP, norms)
        out[f"{name} clip"] = tuple(result), norms
    norms = []
    out[f"{PIPELINE} clip"] = _pipeline(CLIP, norms), norms
    out[TENSOR] = _tensor()
    out["loaded"] = _load_at_ep2(ckpt_dir)
    mesh = RankGrid(dp=2, ep=2)
    hf, hf_opt = expert_parallel(_mixtral(), mesh, optimizer=_opt("adam"))
    out["mixtral"] = mesh.batch_index, _train_mixtral(hf, hf_opt, 4, mesh.batch_index), _global_state(hf)
    return out


def _mixtral():
    """A tiny random Mixtral (transformers) with its sparse blocks on phalanx's MoE layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from phalanx.parallel.expert import from_hf

    cfg = MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                        num_experts_per_tok=2, max_position_embeddings=8)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    from_hf(model, capacity_factor=1.0, aux_loss_weight=cfg.router_aux_loss_coef)
    return model


def _train_mixtral(model, opt, slices, index):
    losses = []
    for step in range(STEPS):
        x, y = _batch("gpt", step, slices)[index]
        loss = _loss("gpt", model(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _load_at_ep2(ckpt_dir):
    """A fresh model at dp 2 × ep 2 (2 experts a rank) loads the checkpoint saved at ep 4."""
    import phalanx.checkpoint as ckpt
    from phalanx.parallel.expert import expert_parallel
    from phalanx.parallel.grid import RankGrid

    model, opt = expert_parallel(_mlp(2, None), RankGrid(dp=2, ep=2), optimizer=_opt("adam"))
    for g in opt.param_groups:  # one step at lr 0, so the experts' Adam state has its keys
        g["lr"] = 0.0
    x, y = _batch("mlp", 0, 4)[0]
    _loss("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    piece = ckpt.ExpertCheckpoint(model, opt)
    ckpt.load(ckpt_dir, {"model": piece, "dense_optim": opt.dense})
    return _global_state(model), piece.state_dict()["optim"], [len(m.experts) for m in _moes(model)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references are tiny: torch's intra-op threads only fight the ranks for the 2 cores
    (one thread: 0.1-0.2 s a reference instead of 1-2 s here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ep") / "step-1")
    return distributed(_four_ranks, np=4, args=(path,), timeout=300)


def _close(a, b, what):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _assert_state(ranks_states, ref_state, name):
    merged = {}
    for state in ranks_states:
        for k, v in state.items():
            if k in merged:  # replicas (dense everywhere, an expert on its dp group) agree
                _close(v, merged[k], f"{name} {k} differs between ranks")
            merged[k] = v
    assert merged.keys() == ref_state.keys(), (name, sorted(set(merged) ^ set(ref_state)))
    for k, v in ref_state.items():
        _close(merged[k], v, f"{name} {k}")


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_one_process(name, runs):
    kind, dp, ep, top_k, cap, _, opt_name = CASES[name]
    losses, dropped, aux, state = _reference(kind, top_k, cap, opt_name, dp * ep)
    results = [r[name] for r in runs]
    for b, r_losses, r_dropped, r_aux, _ in results:
        _close(r_losses, [s[b] for s in losses], f"{name} losses of slice {b}")
        assert r_dropped == [s[b] for s in dropped], f"{name} tokens dropped, slice {b}"
        _close(r_aux, [s[b] for s in aux], f"{name} balance loss of slice {b}")
    _assert_state([r[4] for r in results], state, name)
    if cap is not None and name.startswith("ep4_top1"):
        assert sum(sum(d) for r in results for d in r[2]) > 0, "the capacity case drops no token: make it tighter"


def test_pipeline_and_expert_parallel_match_one_process(runs):
    losses, _, _, state = _reference("gpt", 2, 1.0, "sgd", 2, micro=2)
    results = [r[PIPELINE] for r in runs]
    for _, r_losses, _ in results:  # pm.step reports the mean over the dense group
        mean = [sum(s) / len(s) for s in losses]
        _close(r_losses, mean, f"{PIPELINE} losses")
    _assert_state([r[2] for r in results], state, PIPELINE)


@pytest.mark.parametrize("name", list(CLIPPED) + [PIPELINE])
def test_clipping_by_the_whole_models_norm_with_experts_matches_one_process(name, runs):
    """max_grad_norm (dp 2 x ep 2: all-reduce, ZeRO-2) and pm.clip_grad_norm_ (pp 2 x ep 2) at CLIP, against
    one process clipping with torch's clip_grad_norm_: the experts' squares summed over ep, the dense weights
    counted once; the norms of every step, the losses and the parameters."""
    ref_norms = []
    if name == PIPELINE:
        losses, _, _, state = _reference("gpt", 2, 1.0, "sgd", 2, micro=2, clip=CLIP, norms=ref_norms)
    else:
        kind, dp, ep, top_k, cap, _, opt_name = CASES[name]
        losses, _, _, state = _reference(kind, top_k, cap, opt_name, dp * ep, clip=CLIP, norms=ref_norms)
    assert min(ref_norms) > CLIP, ref_norms  # the clip is active at every step
    results = [r[f"{name} clip"] for r in runs]
    for result, norms in results:
        _close(norms, ref_norms, f"{name} norms")
        b, r_losses = result[0], result[1]
        _close(r_losses, [sum(s) / len(s) for s in losses] if name == PIPELINE else [s[b] for s in losses],
               f"{name} losses")
    _assert_state([result[-1] for result, _ in results], state, name)


def test_tensor_and_expert_parallel_match_one_process(runs):
    losses, _, _, state = _reference("gpt", 2, 1.0, "sgd", 2)
    results = [r[TENSOR] for r in runs]
    for r_losses, _ in results:
        _close(r_losses, [sum(s) / len(s) for s in losses], f"{TENSOR} losses")
    _assert_state([r[1] for r in results], state, TENSOR)


def test_dispatch_is_all_to_all_with_variable_splits(runs):
    splits, all_a2a = runs[0]["splits"]
    assert all_a2a
    send, recv = splits[0]
    assert len(send) == 4 and len(recv) == 4


def test_checkpoint_saved_at_ep4_loads_at_ep2(runs):
    saved = {k: v for r in runs for k, v in r["saved"].items()}  # every rank's experts, global names
    moments = {}  # the stacked Adam moments, rows put together from the 4 savers' Shards
    for r in runs:
        for k, v in r["saved_optim"].items():
            if hasattr(v, "tensor"):
                full = moments.setdefault(k, torch.zeros(v.global_shape))
                full[v.offsets[0]:v.offsets[0] + v.tensor.shape[0]] = v.tensor
    assert moments, "the saved experts' optimizer state has no moments"
    assert {k for r in runs for k in r["loaded"][0]} == saved.keys()
    for state, optim, held in (r["loaded"] for r in runs):
        assert held == [EXPERTS // 2]
        for k, v in state.items():
            _close(v, saved[k], f"loaded {k}")
        for k, full in moments.items():  # each loading rank holds its 2 experts' rows
            v = optim[k]
            _close(v.tensor, full[v.offsets[0]:v.offsets[0] + v.tensor.shape[0]], f"loaded optimizer state {k}")


def test_mixtral_from_transformers_trains_under_expert_parallel(runs):
    """HF Mixtral (random weights) with its sparse blocks swapped for phalanx's MoE, at dp 2 × ep 2,
    against the same model in one process on the four slices in turn."""
    model = _mixtral()
    for moe in _moes(model):
        moe.aux_grad_scale = 0.25
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for x, y in _batch("gpt", step, 4):
            loss = _loss("gpt", model(x).logits, y)
            (loss / 4).backward()
            step_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    for b, r_losses, _ in (r["mixtral"] for r in runs):
        _close(r_losses, [s[b] for s in losses], f"mixtral losses of slice {b}")
    _assert_state([r["mixtral"][2] for r in runs], _global_state(model), "mixtral")


@pytest.mark.unit
def test_hf_blocks_become_the_same_function():
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from phalanx.parallel.expert import from_hf

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=8, moe_intermediate_size=12, intermediate_size=12,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=EXPERTS,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=8)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    for p in model.parameters():
        if p.dim() == 3 or p.shape[0] == EXPERTS:  # experts and router, away from their tiny init
            nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, 16, (2, 6))
    before = model(ids).logits
    assert from_hf(model) == ["model.layers.0.mlp"]
    torch.testing.assert_close(model(ids).logits, before, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- mistakes (no ranks)

@pytest.mark.unit
def test_experts_not_divisible_by_ep_is_one_line():
    from phalanx.parallel.expert import ExpertParallelError, expert_parallel
    from phalanx.parallel.grid import RankGrid

    model = nn.Sequential(MoE(DIM, 3, 1))
    with pytest.raises(ExpertParallelError, match=r"num_experts=3, which does not divide by ep=2"):
        expert_parallel(model, RankGrid(ep=2, world_size=2, rank=0), optimizer=_opt("sgd"))


@pytest.mark.unit
def test_other_mistakes_are_one_line():
    from phalanx.parallel.expert import ExpertParallelError, expert_parallel
    from phalanx.parallel.grid import GridError, RankGrid

    mesh = RankGrid(ep=2, world_size=2, rank=0)
    with pytest.raises(ExpertParallelError, match="has no MoE layer"):
        expert_parallel(nn.Linear(2, 2), mesh, optimizer=_opt("sgd"))
    with pytest.raises(ExpertParallelError, match="data_parallel='zero3' is not supported"):
        expert_parallel(_mlp(1, 1.0), mesh, optimizer=_opt("sgd"), data_parallel="zero3")
    with pytest.raises(ExpertParallelError, match="data_parallel='zero4'"):
        expert_parallel(_mlp(1, 1.0), mesh, optimizer=_opt("sgd"), data_parallel="zero4")
    with pytest.raises(ExpertParallelError, match=r"^expert parallel: max_grad_norm=0: must be a positive number"):
        expert_parallel(_mlp(1, 1.0), mesh, optimizer=_opt("sgd"), max_grad_norm=0)
    with pytest.raises(ExpertParallelError, match="must be a function from parameters"):
        model = _mlp(1, 1.0)
        expert_parallel(model, mesh, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ExpertParallelError, match="use phalanx.parallel.parallelize"):
        expert_parallel(_mlp(1, 1.0), RankGrid(pp=2, ep=2, world_size=4, rank=0), optimizer=_opt("sgd"))
    with pytest.raises(GridError, match=r"dp=1 × pp=1 × tp=1 × ep=3 = 3, but the world size is 4"):
        RankGrid(ep=3, world_size=4)
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        MoE(DIM, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        MoE(DIM, 4, 1, capacity_factor=0)


@pytest.mark.unit
def test_mesh_with_ep_axis():
    from phalanx.parallel.grid import RankGrid

    mesh = RankGrid(dp=2, pp=2, tp=2, ep=2, world_size=16, rank=13)  # the 4-D mesh
    assert (mesh.coord, mesh.e) == ((1, 1, 1), 0)
    assert mesh.tp_ranks == [12, 13] and mesh.ep_ranks == [13, 15]
    assert mesh.pp_ranks == [9, 13] and mesh.dp_ranks == [5, 13]
    assert mesh.dense_ranks == [5, 7, 13, 15]  # same (s, t): dp × ep of them
    every = sorted(r for dim in ("dp", "pp", "ep", "tp") for g in mesh.groups(dim) for r in g)
    assert every == sorted(list(range(16)) * 4)


@pytest.mark.unit
def test_moe_routing_capacity_and_balance_loss():
    from phalanx.models.moe import route

    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.15, 0.8, 0.05]])
    r = route(probs, top_k=1, capacity=2)
    assert r.dropped == 1 and r.counts_E.tolist() == [2, 1, 0]  # token 2 finds expert 0 full
    assert r.token_M.tolist() == [0, 1, 3]
    f = torch.tensor([3, 1, 0]) / 4.0
    torch.testing.assert_close(r.aux_loss, 3 * (f * probs.mean(0)).sum())
    r2 = route(probs, top_k=2, capacity=2)  # first choices queue before second choices
    assert r2.counts_E.tolist() == [2, 2, 1] and r2.dropped == 3  # 0's 3rd first choice, 1's 3rd, 0's 4th
    model = copy.deepcopy(_mlp(2, None))
    out = model[1](torch.randn(5, DIM))
    assert out.shape == (5, DIM) and model[1].last_dropped == 0
