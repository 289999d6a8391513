"""ZeRO stages 1-3 on real gloo ranks against one process training on the full global batch.

Three spawned groups: np=2 (equivalence of every stage on an MLP and a small
transformer, with accumulation and clipping; mixed precision; memory at N=2),
np=4 (memory at N=4; train, save a sharded checkpoint, keep training) and np=2
again (load the world-4 checkpoint, keep training, land on the same parameters).
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.memory import memory_report
from phalanx.parallel.zero import zero
from phalanx.testing import distributed

STEPS, ACCUM, BATCH, MAX_NORM = 20, 2, 8, 0.05


class TinyLM(torch.nn.Module):
    """One pre-norm transformer block over tokens; every parameter used in the loss."""

    def __init__(self, vocab=24, d=16, t=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(t, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)  # a key bias has a zero gradient (softmax shift), which Adam turns into noise
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        x = x + self.proj(a)
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.head(x)


def _mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
    )


def _batch(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)
    idx = torch.randint(0, 24, (BATCH, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(kind, model, x, y):
    out = model(x)
    return F.mse_loss(out, y) if kind == "mlp" else F.cross_entropy(out.flatten(0, 1), y.flatten())


def _reference(kind, model, steps):
    """One process, full global batch, torch Adam, torch's clip_grad_norm_."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    clipped = 0
    for step in steps:
        x, y = _batch(kind, step)
        opt.zero_grad()
        _loss(kind, model, x, y).backward()
        clipped += float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)) > MAX_NORM
        opt.step()
    return clipped


def _train(kind, model, opt, steps, scale=False):
    """Each rank: its slice of the global batch, in ACCUM micro-batches."""
    r, n = px.rank(), px.size()
    for step in steps:
        x, y = _batch(kind, step)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(n)[r].chunk(ACCUM), y.chunk(n)[r].chunk(ACCUM)):
            loss = _loss(kind, model, xm, ym) / ACCUM
            (opt.scale_loss(loss) if scale else loss).backward()
        opt.step()


def _max_diff(sd, ref_sd):
    assert sd.keys() == ref_sd.keys()
    return max((sd[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd)


def _expected_bytes(stage, psi, n, mp):
    """ZeRO paper, Adam: mixed precision 2/2/K=12; fp32 analogue 4/4/K=12 (separate fp32
    master shard) for stages 1-2, and (4+4+8)Ψ/N for stage 3, where the fp32 shard is the parameter."""
    p = 2 if mp else 4
    k = 8 if (stage == 3 and not mp) else 12
    return {
        "params": p * psi / n if stage == 3 else p * psi,
        "grads": p * psi if stage == 1 else p * psi / n,
        "optimizer_state": k * psi / n,
    }


def _memory_checks():
    out = {}
    for stage in (1, 2, 3):
        for mp in (None, "bf16"):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
            psi = sum(p.numel() for p in m.parameters())
            model, opt = zero(m, torch.optim.Adam(m.parameters()), stage=stage, mixed_precision=mp, bucket_mb=0.05)
            model(torch.randn(4, 128)).pow(2).mean().backward()
            opt.step()
            out[(stage, mp)] = (memory_report(opt), _expected_bytes(stage, psi, px.size(), mp))
    return out


def _equivalence_and_memory():
    results = {}
    for kind in ("mlp", "transformer"):
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            m = _mlp() if kind == "mlp" else TinyLM()
            ref = copy.deepcopy(m)
            init = copy.deepcopy(m.state_dict())
            clipped = _reference(kind, ref, range(STEPS))
            opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            model, zopt = zero(m, opt, stage=stage, max_grad_norm=MAX_NORM, bucket_mb=0.002)
            _train(kind, model, zopt, range(STEPS))
            sd = model.state_dict()
            results[(kind, stage)] = (_max_diff(sd, ref.state_dict()), _max_diff(sd, init), clipped)
    # Mixed precision: same run in bf16 / fp16 compute, fp32 masters; close to the fp32 reference.
    for stage, mp in ((1, "fp16"), (2, "bf16"), (3, "bf16")):
        torch.manual_seed(0)
        m = _mlp()
        ref = copy.deepcopy(m)
        _reference("mlp", ref, range(STEPS))
        model, zopt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=stage, max_grad_norm=MAX_NORM,
                           mixed_precision=mp)
        _train("mlp", model, zopt, range(STEPS), scale=mp == "fp16")
        sd = model.state_dict()
        results[("mp", stage, mp)] = (_max_diff(sd, ref.state_dict()), str(next(iter(sd.values())).dtype))
    results["memory"] = _memory_checks()
    return results


def _check_memory(memory, n):
    for (stage, mp), (got, want) in memory.items():
        for key, expect in want.items():
            assert abs(got[key] - expect) <= 0.05 * expect, (stage, mp, n, key, got[key], expect)
        assert got["peak"] > 0


def test_stages_match_full_batch_single_process_and_paper_memory():
    results = distributed(_equivalence_and_memory, np=2, timeout=240)
    for res in results:
        for kind in ("mlp", "transformer"):
            for stage in (1, 2, 3):
                diff, moved, clipped = res[(kind, stage)]
                assert diff < 1e-5, (kind, stage, diff)
                assert moved > 1e-2, (kind, stage, "parameters did not train")
                assert clipped >= STEPS // 2, (kind, stage, "clipping never engaged; the check would be empty")
        for stage, mp in ((1, "fp16"), (2, "bf16"), (3, "bf16")):
            diff, dtype = res[("mp", stage, mp)]
            assert diff < 0.15, (stage, mp, diff)  # 20 Adam steps at lr 1e-2 in bf16 compute drift ~0.1
            assert dtype == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[mp]
        _check_memory(res["memory"], 2)


def _save_at_4(path):
    torch.manual_seed(0)
    m = _mlp()
    model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=3, max_grad_norm=MAX_NORM)
    _train("mlp", model, opt, range(10))
    torch.save(opt.sharded_state_dict(), f"{path}/rank{px.rank()}.pt")
    _train("mlp", model, opt, range(10, STEPS))
    return model.state_dict(), _memory_checks()


def _load_at_2(path):
    out = []
    for stage in (3, 1):
        torch.manual_seed(123)  # different start: everything must come from the checkpoint
        m = _mlp()
        model, opt = zero(m, torch.optim.Adam(m.parameters(), lr=1e-2), stage=stage, max_grad_norm=MAX_NORM)
        opt.load_sharded_state_dict([torch.load(f"{path}/rank{r}.pt") for r in range(4)])
        _train("mlp", model, opt, range(10, STEPS))
        out.append(model.state_dict())
    return out


def test_sharded_checkpoint_saved_at_4_continues_identically_at_2_and_memory_at_4(tmp_path):
    at4 = distributed(_save_at_4, np=4, args=(str(tmp_path),), timeout=240)
    final4, memory4 = at4[0]
    _check_memory(memory4, 4)
    at2 = distributed(_load_at_2, np=2, args=(str(tmp_path),), timeout=240)
    for per_rank in at2:
        for sd in per_rank:
            assert _max_diff(sd, final4) < 1e-5
    torch.manual_seed(0)  # and both equal the single-process run
    ref = _mlp()
    _reference("mlp", ref, range(STEPS))
    assert _max_diff(final4, ref.state_dict()) < 1e-5


def test_bad_arguments_name_the_field():
    m = _mlp()
    opt = torch.optim.Adam(m.parameters())
    with pytest.raises(ValueError, match="stage"):
        zero(m, opt, stage=4)
    with pytest.raises(ValueError, match="mixed_precision"):
        zero(m, opt, stage=1, mixed_precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm"):
        zero(m, opt, stage=2, max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="optimizer"):
        zero(m, "adam", stage=2)
    assert math.isclose(_expected_bytes(3, 100, 4, "bf16")["optimizer_state"], 300.0)


def test_memory_report_of_a_plain_optimizer_reads_tensor_sizes():
    m = _mlp()
    opt = torch.optim.Adam(m.parameters())
    psi = sum(p.numel() for p in m.parameters())
    m(torch.randn(2, 12)).sum().backward()
    opt.step()
    r = memory_report(opt)
    assert (r["params"], r["grads"]) == (4 * psi, 4 * psi)
    assert 8 * psi <= r["optimizer_state"] <= 8 * psi + 4 * len(list(m.parameters()))  # + Adam's step scalars
    assert r["peak"] > 0
    with pytest.raises(TypeError, match="optimizer"):
        memory_report(m)
