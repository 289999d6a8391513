"""Expert parallel vs the same MoE model with its experts replicated (plain data parallel), and a peer.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/expert_parallel.py [--np 2] [--model gpt|mixtral]
          [--layers 2] [--width 256] [--experts 8] [--top-k 2] [--batch 8] [--seq 128] [--steps 8] [--repeats 3]
          [--configs ep,replicated,torchtitan] [--sections step,overlap]

Configurations (fresh ranks each, interleaved within each repeat, medians reported):

* ``ep``          phalanx ``expert_parallel`` on ``RankGrid(ep=np)``: each rank E/np experts, all-to-all dispatch.
* ``replicated``  the same model, every rank all E experts, ``px.DistributedOptimizer`` over all weights.
* ``torchtitan``  torchtitan's MoE layers with their EP sharding and all-to-all token dispatcher (a
                  peer; ``--model stack`` only), when torchtitan is installed and runs (else the line says why).
* ``deepspeed``   DeepSpeed-MoE's layer (``deepspeed.moe.layer.MoE``, ep = np) around the same SwiGLU
                  expert (a peer; ``--model stack`` only).

Models: ``stack`` (default) = ``--layers`` residual MoE layers of SwiGLU experts, the layer the peers
have, so all run the same shapes (phalanx and DeepSpeed drop past ``--capacity``, phalanx sending only
the kept rows, DeepSpeed padding every expert to capacity; torchtitan has no capacity and drops none); ``gpt`` = phalanx's GPT with MoE blocks; ``mixtral`` = a random
transformers Mixtral with its sparse blocks on phalanx's MoE (``from_hf``).

Every rank trains on its own ``--batch x --seq`` tokens (the same global batch in every
config); Adam. "step" is the median wall time of a step (forward, backward, optimizer);
"model MiB" the bytes of parameters + gradients + Adam state a rank holds (counted from
the tensors); "peak MiB" the rise of the process's peak RSS over its RSS before the model
was built (max over ranks; includes activations and allocator slack). The ratios printed
are ep / replicated (step time: < 1 = ep faster; memory: < 1 = ep smaller).

``--sections overlap`` measures whether overlapping one chunk's dispatch with another
chunk's expert compute could pay here: on each rank an all-to-all of one MoE layer's
dispatched rows alone, the experts' compute on them alone, and both at once (the
all-to-all launched asynchronously, the compute run, then the wait).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import phalanx as px


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _gpt(a):
    from phalanx.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=a.seq, n_layer=a.layers, n_head=4, n_embd=a.width,
                         n_experts=a.experts, moe_top_k=a.top_k, capacity_factor=a.capacity))


def _mixtral(a):
    from transformers import MixtralConfig, MixtralForCausalLM

    from phalanx.parallel.expert import from_hf

    cfg = MixtralConfig(vocab_size=256, hidden_size=a.width, intermediate_size=2 * a.width, num_hidden_layers=a.layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=a.experts,
                        num_experts_per_tok=a.top_k, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    from_hf(model, capacity_factor=a.capacity, aux_loss_weight=cfg.router_aux_loss_coef)
    return model


def _stack(a):
    """--layers residual MoE layers of SwiGLU experts (hidden 4·width, capacity ``--capacity`` as DeepSpeed's):
    the layer the peers have, in phalanx."""
    from phalanx.models.moe import GatedExpert, MoE

    torch.manual_seed(0)
    h = 4 * a.width

    def expert(_):
        return GatedExpert(torch.randn(2 * h, a.width) * 0.02, torch.randn(a.width, h) * 0.02)

    layers = [MoE(a.width, a.experts, a.top_k, capacity_factor=a.capacity, expert=expert, aux_loss_weight=0.0)
              for _ in range(a.layers)]
    return Residual(layers)


class Residual(torch.nn.Module):
    """x + layer(x), layer after layer; ``forward(x_BTD) -> x_BTD``."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _state_bytes(params, opt_state) -> int:
    n = sum(p.numel() * p.element_size() * 2 for p in params)  # weight + gradient
    return n + sum(t.numel() * t.element_size() for s in opt_state for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)


def _titan(a):
    """torchtitan's MoE layers (router, grouped SwiGLU experts, AllToAllTokenDispatcher) under its EP sharding.

    Four settings make it run on CPU / gloo (torchtitan 0.3.0 is written for its trainer on GPUs):
    ``device_type = "cpu"`` (it assumes "cuda" when torch has no accelerator), the
    ``partial_dtensor`` backend (its default ``spmd_types`` needs the trainer's mesh context),
    ``set_moe_sharding_config(enable_ep=True)`` and ``ParallelDims(ep=np).build_mesh()``. Its
    experts compute in bf16 (``GroupedExperts`` casts to bf16 for ``torch._grouped_mm``).
    """
    from torch.distributed.tensor import Shard
    from torchtitan.distributed import parallel_dims as titan_dims
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        GroupedExperts,
        MoE,
        RoutedExperts,
        TokenChoiceTopKRouter,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    titan_dims.device_type = "cpu"
    titan_utils.set_spmd_backend("partial_dtensor")
    pd = titan_dims.ParallelDims(dp_replicate=1, dp_shard=px.size(), cp=1, tp=1, pp=1, ep=px.size(),
                                 world_size=px.size(), spmd_backend="partial_dtensor")
    pd.build_mesh()
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        cfg = MoE.Config(
            num_experts=a.experts, load_balance_coeff=None,
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=a.width, hidden_dim=4 * a.width, num_experts=a.experts),
                token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=a.experts, top_k=a.top_k)),
            router=TokenChoiceTopKRouter.Config(num_experts=a.experts, top_k=a.top_k, score_func="softmax",
                                                route_norm=True,
                                                gate=Linear.Config(in_features=a.width, out_features=a.experts)))
        set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                                expert_param_layout={"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)})
        moe = cfg.build()
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        moe.parallelize(pd)
        layers.append(moe)
    return Residual(layers)


def _deepspeed(a):
    """DeepSpeed-MoE's layer (``deepspeed.moe.layer.MoE``, top-k gating, its all-to-all over an expert
    group of ep = np) around the same SwiGLU expert. Runs on CPU / gloo as is (deepspeed builds its
    shared-memory comm op on first use) with its default fixed capacity (``--capacity``, tokens past it
    dropped, every expert's buffer padded to it); with ``drop_tokens=False`` (no drop, like the other
    configs) its all-to-all aborted the rank here: gloo "op.preamble.length <= op.nbytes. 2816 vs 2304.
    Received data size doesn't match expected size" (deepspeed 0.19.8)."""
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from phalanx.models.moe import GatedExpert

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = 4 * a.width
    layers = []
    for _ in range(a.layers):
        expert = GatedExpert(torch.randn(2 * h, a.width) * 0.02, torch.randn(a.width, h) * 0.02)
        layers.append(Unpack(DeepSpeedMoE(hidden_size=a.width, expert=expert, num_experts=a.experts,
                                          ep_size=px.size(), k=a.top_k, capacity_factor=a.capacity,
                                          eval_capacity_factor=a.capacity)))
    return Residual(layers)


class Unpack(torch.nn.Module):
    """DeepSpeed's MoE returns ``(out, aux_loss, counts)``; keep ``out``."""

    def __init__(self, moe) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)[0]


def _bench(config, a):
    import torch.distributed as dist

    dist.barrier()
    dist.all_gather_object([None] * dist.get_world_size(), config)
    base = _rss()
    n, r = px.size(), px.rank()
    if config in PEERS:
        try:
            model = PEERS[config](a)
        except Exception as e:  # noqa: BLE001 - the peer's own failure is the result to report
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        # (their router weights are not averaged across ranks here: a (E, width) all-reduce they are spared;
        # DeepSpeed's engine would do that, and reduce its experts over their data-parallel group)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        model = {"stack": _stack, "gpt": _gpt, "mixtral": _mixtral}[a.model](a)
        if config == "ep":
            from phalanx.parallel.expert import expert_parallel
            from phalanx.parallel.grid import RankGrid

            model, opt = expert_parallel(model, RankGrid(ep=n), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
        else:
            px.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = px.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                          named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(1000 + r)
    ids = torch.randint(0, 256, (a.batch, a.seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    stack = config in PEERS or a.model == "stack"
    if stack:
        x = torch.randn(a.batch, a.seq, a.width, generator=g)

    def step():
        opt.zero_grad()
        if stack:
            model(x).pow(2).mean().backward()
        else:
            F.cross_entropy(_logits(model(x)).flatten(0, 1), y.flatten()).backward()
        opt.step()

    try:
        for _ in range(2):
            step()
    except Exception as e:  # noqa: BLE001
        if config not in PEERS:
            raise
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    inner = getattr(opt, "optimizer", opt)
    if config == "ep":
        states = list(opt.dense.optimizer.state.values()) + list(opt.experts.optimizer.state.values())
    else:
        states = list(inner.state.values())
    params = [getattr(p, "_local_tensor", p) for p in model.parameters()]  # a DTensor: this rank's shard
    states = [{k: getattr(v, "_local_tensor", v) for k, v in s.items()} for s in states]
    return {"step_s": statistics.median(times), "peak": peak, "model_bytes": _state_bytes(params, states)}


def _overlap(a):
    """One MoE layer's dispatch all-to-all vs its experts' compute, alone and at once."""
    import torch.distributed as dist

    from phalanx.models.moe import ExpertMLP

    n = px.size()
    rows = a.batch * a.seq * a.top_k  # rows a rank sends (and about what it receives)
    torch.manual_seed(px.rank())
    x = torch.randn(rows, a.width)
    experts = [ExpertMLP(a.width, 4 * a.width) for _ in range(a.experts // n)]
    out = torch.empty_like(x)

    def compute():
        for e, chunk in zip(experts, x.chunk(len(experts))):
            e(chunk).sum().backward()  # forward + backward, as one training step's expert work

    def exchange(async_op=False):
        return dist.all_to_all_single(out, x, async_op=async_op)

    res = {"a2a": [], "compute": [], "both": []}
    for _ in range(3):
        exchange()
        compute()
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        exchange()
        res["a2a"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        compute()
        res["compute"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        work = exchange(async_op=True)
        compute()
        work.wait()
        res["both"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in res.items()} | {"mib": x.numel() * 4 / 2**20}


PEERS = {"torchtitan": _titan, "deepspeed": _deepspeed}
CONFIGS = ["ep", "replicated", "torchtitan", "deepspeed"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--model", choices=("stack", "gpt", "mixtral"), default="stack")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=1.25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=None, help="default: ep,replicated,torchtitan,deepspeed for --model "
                    "stack, else ep,replicated (the peers run their own MoE layers only)")
    ap.add_argument("--sections", default="step,overlap")
    a = ap.parse_args()
    configs = [c for c in (a.configs or ",".join(CONFIGS if a.model == "stack" else CONFIGS[:2])).split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; choose from {CONFIGS}")
    sections = set(a.sections.split(","))
    print(f"model: {a.model}, {a.layers} MoE layers, width {a.width}, {a.experts} experts, top-{a.top_k}, "
          f"capacity {a.capacity}; np={a.np}, {a.batch}x{a.seq} tokens a rank, Adam, {a.steps} timed steps, "
          f"{a.repeats} repeats (interleaved), torch {torch.__version__}")
    if "step" in sections:
        runs: dict[str, list[dict]] = {c: [] for c in configs}
        for rep in range(a.repeats):
            for c in (configs if rep % 2 == 0 else configs[::-1]):
                res = px.run(_bench, np=a.np, args=(c, a), timeout=600)
                if "error" in res[0]:
                    runs[c].append(res[0])
                    continue
                runs[c].append({"step_s": max(r["step_s"] for r in res), "peak": max(r["peak"] for r in res),
                                "model_bytes": max(r["model_bytes"] for r in res)})
        print("\n| config | step ms (median of repeats) | model MiB/rank | peak RSS MiB/rank | vs replicated (time, model mem) |")
        print("|---|---|---|---|---|")
        med, failed = {}, {}
        for c in configs:
            ok = [r for r in runs[c] if "error" not in r]
            if ok:
                med[c] = {k: statistics.median(r[k] for r in ok) for k in ("step_s", "peak", "model_bytes")}
                med[c]["each"] = ", ".join(f"{r['step_s'] * 1e3:.1f}" for r in ok)
            else:
                failed[c] = runs[c][0]["error"]
        for c in configs:
            if c in failed:
                print(f"| {c} | does not run here: {failed[c]} | - | - | - |")
                continue
            m, vs = med[c], ""
            if c != "replicated" and "replicated" in med:
                p = med["replicated"]
                vs = f"{m['step_s'] / p['step_s']:.2f}x time, {m['model_bytes'] / p['model_bytes']:.2f}x model memory"
            print(f"| {c} | {m['step_s'] * 1e3:.1f} ({m['each']}) | {m['model_bytes'] / 2**20:.2f} | "
                  f"{m['peak'] / 2**20:.0f} | {vs} |")
        for peer in ("replicated", "torchtitan", "deepspeed"):
            if "ep" in med and peer in med:  # paired: each repeat's ratio (the load here drifts between repeats)
                pairs = [e["step_s"] / p["step_s"] for e, p in zip(runs["ep"], runs[peer])
                         if "error" not in e and "error" not in p]
                e, p = med["ep"], med[peer]
                print(f"\nratio ep / {peer}: step time {statistics.median(pairs):.2f}x (median of the repeats' ratios "
                      f"{', '.join(f'{x:.2f}' for x in pairs)}), model memory {e['model_bytes'] / p['model_bytes']:.2f}x, "
                      f"peak RSS {e['peak'] / p['peak']:.2f}x")
    if "overlap" in sections:
        res = px.run(_overlap, np=a.np, args=(a,), timeout=300)
        worst = {k: max(r[k] for r in res) for k in ("a2a", "compute", "both")}
        print(f"\noverlap (one MoE layer's dispatch, {res[0]['mib']:.2f} MiB a rank): all-to-all alone "
              f"{worst['a2a'] * 1e3:.2f} ms, the experts' forward + backward on those rows alone "
              f"{worst['compute'] * 1e3:.2f} ms, both at once {worst['both'] * 1e3:.2f} ms. Overlapping a chunk's "
              f"dispatch with another's compute can save at most the all-to-all: "
              f"{worst['a2a'] / (worst['a2a'] + worst['compute']):.1%} of the pair's time")


if __name__ == "__main__":
    main()
