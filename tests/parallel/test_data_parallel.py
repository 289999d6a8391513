"""Data-parallel engine: N ranks with local batch b == one process with batch N*b.

Every rank also computes the single-process reference itself (the models are
tiny), so each body returns max |param - reference| per case and the test
asserts it is below 1e-5 after 20 steps. One spawned group per model family.
"""

import copy

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.parallel.data import VIEW_MIN_NUMEL, DataParallel
from phalanx.parallel.data.optimizer import DistributedOptimizer
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

STEPS = 20
B = 4  # local batch
TOL = 1e-5


def _batch(step: int, n: int, shape, classes: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn((n,) + tuple(shape), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def _diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


def _wide(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 5))


def _opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _equivalence(make, kind, *, chunks_ref=False, k=1, dp_kwargs=None, shape=(8,), loss_of=None, make_ref=None,
                 set_to_none=True):
    """Train DataParallel(make()) and a reference for STEPS steps; return max parameter difference."""
    r, n = px.rank(), px.size()
    loss_fn = nn.CrossEntropyLoss()
    loss_of = loss_of or (lambda m, x, y, step, chunk: loss_fn(m(x), y))
    ref = (make_ref or make)()
    dp = DataParallel(make(), bucket_mb=0.0005, **(dp_kwargs or {}))  # tiny buckets: several per model
    opt_ref, opt_dp = _opt(kind, ref.parameters()), _opt(kind, dp.parameters())
    for step in range(STEPS):
        x, y = _batch(step, n * B * k, shape)
        opt_ref.zero_grad()
        if chunks_ref:  # per-rank statistics (BatchNorm, branch choice): mean of per-chunk losses
            loss = sum(loss_of(ref, x[c * B:(c + 1) * B], y[c * B:(c + 1) * B], step, c)
                       for c in range(n)) / n
        else:
            loss = loss_of(ref, x, y, step, None)
        loss.backward()
        opt_ref.step()
        opt_dp.zero_grad(set_to_none=set_to_none)
        for j in range(k):  # micro-batches j of this rank: rows of the global batch owned by rank r
            lo = (j * n + r) * B
            xs, ys = x[lo:lo + B], y[lo:lo + B]
            if j < k - 1:
                with dp.no_sync():
                    (loss_of(dp, xs, ys, step, r) / k).backward()
            else:
                (loss_of(dp, xs, ys, step, r) / k).backward()
        opt_dp.step()
    return _diff(ref, dp.module)


def _mlp_family():
    out = {}
    for kind in ("sgd", "adam"):
        out[f"mlp_{kind}"] = _equivalence(_mlp, kind)
        out[f"mlp_{kind}_accum4"] = _equivalence(_mlp, kind, k=4)
        # zero_grad(set_to_none=False): backward accumulates straight into the bucket views
        # (weights of >= VIEW_MIN_NUMEL elements get views; the small biases are copied back)
        out[f"wide_{kind}_accum2_in_bucket"] = _equivalence(_wide, kind, k=2, set_to_none=False)
    viewed = DataParallel(_wide())
    for _ in range(2):
        viewed.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(viewed(torch.randn(4, 8)), torch.randint(0, 5, (4,))).backward()
    flats = [(b.flat.data_ptr(), b.flat.data_ptr() + b.nbytes) for b in viewed._engine.buckets.buckets]
    in_bucket = [any(lo <= p.grad.data_ptr() < hi for lo, hi in flats) for p in viewed.parameters()]
    out["grads_in_buckets"] = in_bucket == [p.numel() >= VIEW_MIN_NUMEL for p in viewed.parameters()] and any(in_bucket)

    # unused branch: rank r takes head b when (step + r) % 3 == 0, so head b is used on some ranks,
    # on no rank in other steps (its grad must stay None: momentum/Adam must not move it)
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 5), nn.Linear(16, 5)

        def forward(self, x, use_b=False):
            h = torch.relu(self.body(x))
            return self.b(h) if use_b else self.a(h)

    def branch_loss(m, x, y, step, chunk):
        if chunk is None:
            raise AssertionError("unused-branch reference must be per chunk")
        return nn.functional.cross_entropy(m(x, use_b=(step + chunk) % 3 == 0), y)

    for kind in ("sgd", "adam"):
        out[f"unused_{kind}"] = _equivalence(TwoHeads, kind, chunks_ref=True, loss_of=branch_loss,
                                             dp_kwargs={"find_unused_parameters": True})

    def frozen():
        m = _mlp(2)
        m[0].requires_grad_(False)
        return m

    out["frozen_sgd"] = _equivalence(frozen, "sgd")
    out["frozen_adam"] = _equivalence(frozen, "adam")

    # requires_grad toggled after wrapping (needs find_unused_parameters=True)
    def toggle_loss(m, x, y, step, chunk):
        mod = m.module if isinstance(m, DataParallel) else m
        mod[2].requires_grad_(step < 10)
        return nn.functional.cross_entropy(m(x), y)

    out["toggle_sgd"] = _equivalence(_mlp, "sgd", loss_of=toggle_loss, dp_kwargs={"find_unused_parameters": True})

    # freeze after wrapping, then unfreeze (fine-tuning): buckets follow requires_grad, no flag needed
    def unfreeze_loss(m, x, y, step, chunk):
        mod = m.module if isinstance(m, DataParallel) else m
        mod[0].requires_grad_(step >= 10)
        return nn.functional.cross_entropy(m(x), y)

    out["unfreeze_adam"] = _equivalence(_mlp, "adam", loss_of=unfreeze_loss)

    # other allreduce algorithms (issue 6) and a non-summable compressor (issue 5) plug in
    out["ring_sgd"] = _equivalence(_mlp, "sgd", dp_kwargs={"algorithm": "ring"})
    dense_dp, int8_dp = DataParallel(_mlp()), DataParallel(_mlp(), compression="int8")
    x, y = _batch(1, B, (8,), seed=px.rank() + 1)
    for m in (dense_dp, int8_dp):
        nn.functional.cross_entropy(m(x), y).backward()
    out["int8_grad_diff"] = max((p.grad - q.grad).abs().max().item()
                                for p, q in zip(dense_dp.parameters(), int8_dp.parameters()))
    out["int8_bytes"] = (dense_dp.bytes_sent, int8_dp.bytes_sent)

    # fp16 compression halves the bytes and stays close; bytes_sent counts the payload
    plain = DataParallel(_mlp())
    half = DataParallel(_mlp(), compression="fp16")
    x, y = _batch(0, B, (8,), seed=px.rank() + 1)
    for m in (plain, half):
        nn.functional.cross_entropy(m(x), y).backward()
    out["fp16_grad_diff"] = max((p.grad - q.grad).abs().max().item()
                                for p, q in zip(plain.parameters(), half.parameters()))
    out["bytes"] = (plain.bytes_sent, half.bytes_sent)

    # a lossy codec may drop NaN (a threshold never selects it): ranks must still agree to skip,
    # and the residuals of that step must not poison the next one
    lossy = DataParallel(_mlp(), compression="threshold")
    x, y = _batch(4, B, (8,), seed=px.rank() + 1)
    poison = float("nan") if px.rank() == 1 else 1.0
    (nn.functional.cross_entropy(lossy(x), y) * poison).backward()
    out["nan_everywhere"] = all(torch.isnan(p.grad).all().item() for p in lossy.parameters())
    out["residuals_cleared"] = not lossy._engine.compressor.memory.residuals
    lossy.zero_grad()
    nn.functional.cross_entropy(lossy(x), y).backward()
    out["finite_after"] = all(torch.isfinite(p.grad).all().item() for p in lossy.parameters())

    # sample weights: rank r's gradient counts with weight w_r
    weights = [0.25, 0.75]
    w = DataParallel(_mlp())
    w.set_sample_weight(weights[px.rank()])
    x, y = _batch(3, B, (8,), seed=px.rank() + 1)
    nn.functional.cross_entropy(w(x), y).backward()
    ref = _mlp()
    parts = []
    for rr in range(2):
        ref.zero_grad()
        xr, yr = _batch(3, B, (8,), seed=rr + 1)
        nn.functional.cross_entropy(ref(xr), yr).backward()
        parts.append([p.grad.clone() for p in ref.parameters()])
    expect = [weights[0] * a + weights[1] * b for a, b in zip(*parts)]
    out["weighted"] = max((p.grad - e).abs().max().item() for p, e in zip(w.parameters(), expect))

    # state_dict: the plain module's keys, loadable into a plain module
    sd = w.state_dict()
    plain_copy = _mlp(5)
    plain_copy.load_state_dict(sd)
    out["state_keys_plain"] = list(sd) == list(_mlp().state_dict())
    out["state_roundtrip"] = _diff(plain_copy, w.module)

    # a wrong setting gets a clear message (both ranks skip head b here, so both raise)
    bad = DataParallel(TwoHeads())
    try:
        nn.functional.cross_entropy(bad(x), y).backward()
        out["unused_error"] = ""
    except RuntimeError as err:
        out["unused_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def mlp_family():
    """One spawned group runs every MLP case; each check below is its own test."""
    return distributed(_mlp_family, np=2, timeout=150)


# max |param - reference| after STEPS steps, each < TOL on every rank
MLP_EQUIVALENT = [
    "mlp_sgd", "mlp_adam", "mlp_sgd_accum4", "mlp_adam_accum4", "wide_sgd_accum2_in_bucket", "wide_adam_accum2_in_bucket",
    "unused_sgd", "unused_adam", "frozen_sgd", "frozen_adam", "toggle_sgd", "unfreeze_adam", "ring_sgd",
    "weighted", "state_roundtrip"]
MLP_CHECKS = {  # one rank's results -> assertion
    "fp16_grads_close": lambda out: out["fp16_grad_diff"] < 1e-2 or _fail(out["fp16_grad_diff"]),
    "fp16_halves_the_bytes": lambda out: (out["bytes"][0] > 0 and 2 * out["bytes"][1] == out["bytes"][0])
    or _fail(out["bytes"]),
    "int8_grads_close": lambda out: out["int8_grad_diff"] < 5e-2 or _fail(out["int8_grad_diff"]),
    "int8_sends_under_half": lambda out: 0 < out["int8_bytes"][1] < out["int8_bytes"][0] / 2 or _fail(out["int8_bytes"]),
    "state_dict_has_the_plain_keys": lambda out: out["state_keys_plain"] or _fail(out),
    "nan_on_one_rank_skips_everywhere": lambda out: (out["nan_everywhere"] and out["residuals_cleared"]
                                                     and out["finite_after"]) or _fail(out),
    "large_grads_stay_bucket_views": lambda out: out["grads_in_buckets"] or _fail(out),
    "an_unused_parameter_is_named": lambda out: ("find_unused_parameters=True" in out["unused_error"]
                                                 and "b.weight" in out["unused_error"]) or _fail(out["unused_error"]),
}
_MLP_OTHER_KEYS = {"bytes", "state_keys_plain", "unused_error", "fp16_grad_diff", "int8_grad_diff", "int8_bytes",
                   "nan_everywhere", "residuals_cleared", "finite_after", "grads_in_buckets"}


def _fail(got):
    raise AssertionError(f"got {got!r}")


@pytest.mark.parametrize("case", MLP_EQUIVALENT)
def test_mlp_family_equivalence(case, mlp_family):
    for r, out in enumerate(mlp_family):
        assert out[case] < TOL, f"rank {r} {case}: max |param - reference| = {out[case]}"


@pytest.mark.parametrize("check", list(MLP_CHECKS))
def test_mlp_family(check, mlp_family):
    for out in mlp_family:
        MLP_CHECKS[check](out)


def test_mlp_family_checks_every_case_it_runs(mlp_family):
    """A case added to the body without a check here would pass unseen."""
    assert set(mlp_family[0]) == set(MLP_EQUIVALENT) | _MLP_OTHER_KEYS


def _cnn():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 5),
    )


class _Bag(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(50, 8, sparse=sparse)
        self.head = nn.Linear(8, 5)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


class _FnBag(_Bag):
    """A sparse embedding DataParallel cannot see at wrap time (built with sparse=False, looked up
    with a sparse functional call): the engine finds its gradient sparse in the first step and
    takes it out of the buckets."""

    def forward(self, ids):
        return self.head(nn.functional.embedding(ids, self.emb.weight, sparse=True).mean(1))


def _ids_loss(m, x, y, step, chunk):
    ids = (x.abs() * 7).long().clamp_(0, 49)  # x: (batch, 6) random floats -> token ids
    return nn.functional.cross_entropy(m(ids), y)


def _cnn_and_embedding_family():
    out = {}
    for kind in ("sgd", "adam"):
        # BatchNorm statistics are per rank (as in DDP): the exact reference is the mean of the
        # per-chunk losses of the full batch, each chunk normalised by its own statistics
        out[f"cnn_bn_{kind}"] = _equivalence(_cnn, kind, chunks_ref=True, shape=(1, 8, 8))
        out[f"emb_dense_{kind}"] = _equivalence(lambda: _Bag(False), kind, shape=(6,), loss_of=_ids_loss)
        out[f"emb_sparse_as_dense_{kind}"] = _equivalence(
            lambda: _Bag(True), kind, shape=(6,), loss_of=_ids_loss, make_ref=lambda: _Bag(False),
            dp_kwargs={"sparse_as_dense": True})
    # sparse gradients reduced by allgather (SGD supports sparse grads; Adam does not), for an
    # nn.Embedding(sparse=True) and for a sparse embedding found only when its gradient arrives
    n, r = px.size(), px.rank()
    for key, make in (("emb_sparse_sgd", lambda: _Bag(True)), ("emb_sparse_found_sgd", lambda: _FnBag(False))):
        ref, dp = make(), DataParallel(make())
        o_ref, o_dp = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(dp.parameters(), lr=0.5)
        for step in range(STEPS):
            x, y = _batch(step, n * B, (6,))
            o_ref.zero_grad()
            _ids_loss(ref, x, y, step, None).backward()
            o_ref.step()
            o_dp.zero_grad()
            _ids_loss(dp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B], step, r).backward()
            out.setdefault("emb_sparse_grad_is_sparse", []).append(dp.module.emb.weight.grad.is_sparse)
            o_dp.step()
        out[key] = _diff(ref, dp.module)
    # buffers (running stats) are broadcast from rank 0 before each forward: equal everywhere
    m = DataParallel(_cnn())
    for step in range(3):
        x, _ = _batch(step, B, (1, 8, 8), seed=r + 7)
        m(x).sum().backward()
    m.eval()
    m(x)  # buffers are broadcast from rank 0 before every forward (eval: not updated after)
    out["buffers"] = {k: v.clone() for k, v in m.module.named_buffers()}
    return out


@pytest.fixture(scope="module")
def cnn_family():
    """One spawned group runs every CNN / embedding case; each check below is its own test."""
    return distributed(_cnn_and_embedding_family, np=2, timeout=150)


CNN_EQUIVALENT = [f"{case}_{kind}" for case in ("cnn_bn", "emb_dense", "emb_sparse_as_dense") for kind in ("sgd", "adam")] \
    + ["emb_sparse_sgd", "emb_sparse_found_sgd"]


@pytest.mark.parametrize("case", CNN_EQUIVALENT)
def test_cnn_batchnorm_and_embedding_equivalence(case, cnn_family):
    for r, out in enumerate(cnn_family):
        value = out[case]
        assert value is not None and value < TOL, f"rank {r} {case}: max |param - reference| = {value}"


def test_sparse_embedding_gradients_stay_sparse(cnn_family):
    for out in cnn_family:
        assert out["emb_sparse_grad_is_sparse"] == [True] * (2 * STEPS)


def test_batchnorm_buffers_are_rank_0s_everywhere(cnn_family):
    for r, out in enumerate(cnn_family):
        for name, t in out["buffers"].items():
            torch.testing.assert_close(t, cnn_family[0]["buffers"][name], msg=f"buffer {name} differs on rank {r}")


def test_cnn_family_checks_every_case_it_runs(cnn_family):
    assert set(cnn_family[0]) == set(CNN_EQUIVALENT) | {"emb_sparse_grad_is_sparse", "buffers"}


def _distributed_optimizer_family():
    r, n = px.rank(), px.size()
    out = {}
    for kind in ("sgd", "adam"):
        for k in (1, 4):
            ref, model = _mlp(), _mlp(9)
            px.broadcast_parameters(model.state_dict(), root_rank=0)
            model.load_state_dict(ref.state_dict())  # same start as the reference
            opt_ref = _opt(kind, ref.parameters())
            opt = DistributedOptimizer(_opt(kind, model.parameters()), model.named_parameters(),
                                       backward_passes_per_step=k, bucket_mb=0.0005)
            px.broadcast_optimizer_state(opt, root_rank=0)  # empty state: must not fail
            for step in range(STEPS):
                x, y = _batch(step, n * B * k, (8,))
                opt_ref.zero_grad()
                nn.functional.cross_entropy(ref(x), y).backward()
                nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                opt_ref.step()
                opt.zero_grad()
                for j in range(k):
                    lo = (j * n + r) * B
                    (nn.functional.cross_entropy(model(x[lo:lo + B]), y[lo:lo + B]) / k).backward()
                opt.synchronize()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # clipping sees the averaged gradient
                with opt.skip_synchronize():
                    opt.step()
            out[f"distopt_{kind}_k{k}"] = _diff(ref, model)
    # optimizer state from rank 0 reaches everyone (non-empty, different per rank before)
    m = _mlp()
    inner = torch.optim.Adam(m.parameters(), lr=1e-3 * (r + 1))
    m(torch.randn(2, 8)).sum().backward()
    inner.step()
    px.broadcast_optimizer_state(inner, root_rank=0)
    out["bcast_lr"] = inner.param_groups[0]["lr"]
    out["bcast_state"] = inner.state_dict()["state"][0]["exp_avg"].clone()
    # GradScaler: rank 1 alone sees inf at step 2; every rank must skip that step
    model = _mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    scaler = torch.amp.GradScaler(px.topology().device.type, init_scale=2.0**8)
    skipped = []
    for step in range(4):
        x, y = _batch(step, B, (8,), seed=r + 1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if step == 2 and r == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    out["skipped"] = skipped
    out["scale"] = scaler.get_scale()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    # torch's LR schedulers take phalanx's wrappers (they are torch.optim.Optimizers to torch), and the
    # learning rate they set is the one the wrapped optimizer steps with: vs one process with the same schedule
    for wrap in ("distributed", "zero1", "zero3"):
        ref, model = _mlp(), _mlp()
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
        sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=2, gamma=0.5)
        inner = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if wrap == "distributed":
            opt = DistributedOptimizer(inner, model.named_parameters())
        else:
            model, opt = px.zero(model, inner, stage=int(wrap[-1]))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for step in range(6):
            x, y = _batch(step, n * B, (8,))
            for o, m, xs, ys in ((opt_ref, ref, x, y), (opt, model, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])):
                o.zero_grad()
                nn.functional.cross_entropy(m(xs), ys).backward()
                o.step()
            sched_ref.step()
            sched.step()
        with torch.no_grad():
            full = dict(model.state_dict())
        out[f"sched_{wrap}"] = (max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
                                opt.param_groups[0]["lr"], sched.get_last_lr())
    return out


def test_distributed_optimizer_equivalence_and_amp():
    results = distributed(_distributed_optimizer_family, np=2, timeout=150)
    for r, out in enumerate(results):
        for kind in ("sgd", "adam"):
            for k in (1, 4):
                v = out[f"distopt_{kind}_k{k}"]
                assert v < TOL, f"rank {r} distopt {kind} k={k}: {v}"
        assert out["bcast_lr"] == 1e-3
        torch.testing.assert_close(out["bcast_state"], results[0]["bcast_state"])
        assert out["skipped"] == [False, False, True, False], out["skipped"]
        assert out["scale"] == results[0]["scale"] == 2.0**7
        for a, b in zip(out["params"], results[0]["params"]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        for wrap in ("distributed", "zero1", "zero3"):
            diff, lr, last = out[f"sched_{wrap}"]
            assert diff < TOL and lr == pytest.approx(0.025) and last == [pytest.approx(0.025)], (r, wrap, diff, lr, last)


def _join_uneven():
    """Rank 0 has 5 batches, rank 1 has 3: afterwards rank 1 contributes zeros (mean over 2)."""
    r = px.rank()
    ref, dp = _mlp(), DataParallel(_mlp(), find_unused_parameters=False)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    counts = [5, 3]
    with dp.join():
        for step in range(counts[r]):
            x, y = _batch(step, 2 * B, (8,))
            opt.zero_grad()
            nn.functional.cross_entropy(dp(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
            opt.step()
    for step in range(counts[0]):
        x, y = _batch(step, 2 * B, (8,))
        opt_ref.zero_grad()
        live = [c for c in range(2) if step < counts[c]]
        loss = sum(nn.functional.cross_entropy(ref(x[c * B:(c + 1) * B]), y[c * B:(c + 1) * B]) for c in live) / 2
        loss.backward()
        opt_ref.step()
    return _diff(ref, dp.module) if r == 0 else 0.0


def test_join_uneven_inputs():
    diffs = distributed(_join_uneven, np=2, timeout=60)
    assert diffs[0] < TOL, diffs


def _single_process_body():
    m = DataParallel(_mlp())
    ref = copy.deepcopy(m.module)
    x, y = _batch(0, B, (8,))
    nn.functional.cross_entropy(m(x), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    d = max((p.grad - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
    errors = []
    for kwargs in ({"op": px.Max}, {"gradient_predivide_factor": 0}, {"bucket_mb": 0}):
        try:
            DataParallel(_mlp(), **kwargs)
        except ValueError as err:
            errors.append(str(err))
    return d, errors


def test_single_process_passthrough_and_bad_input():
    # A world of one: no collectives, gradients untouched; bad kwargs name the field.
    d, errors = distributed(_single_process_body, np=1)[0]
    assert d == 0.0
    assert len(errors) == 3 and "op" in errors[0] and "gradient_predivide_factor" in errors[1] \
        and "bucket_mb" in errors[2]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_engine_plan_and_padded_buckets_keep_the_bucket_interface():
    """ZeRO's fixed plan: padded buckets carry every attribute of a plain Bucket, the plan is
    fixed (re-planning and set_bucket_mb leave it), and a plan must cover each parameter once."""
    from phalanx.comm.buckets import Bucket, PaddedBucket, PlannedBuckets
    from phalanx.parallel.data.config import EngineConfig
    from phalanx.parallel.data.gradients import GradientEngine
    from phalanx.planner.autotune import set_bucket_mb

    a, b, c = (nn.Parameter(torch.randn(n)) for n in (5, 3, 4))
    plain, padded = Bucket(0, [a, b]), PaddedBucket(0, [a, b], pad_to=4)
    assert set(vars(plain)) <= set(vars(padded))
    assert (padded.numel, padded.padded, padded.flat.numel()) == (8, 8, 8)
    assert PaddedBucket(0, [a, c], pad_to=4).padded == 12
    lazy = PaddedBucket(0, [a], pad_to=2, lazy=True)
    assert lazy.flat.untyped_storage().nbytes() == 0 and lazy.views[0].shape == a.shape
    done = []
    mgr = PlannedBuckets([[c], [a, b]], lambda bucket: done.append(bucket.index), pad_to=2,
                         on_complete=lambda bucket: done.append(("complete", bucket.index)))
    before = [bk.params for bk in mgr.buckets]
    assert mgr.maybe_rebuild([1, 0, 2]) is False and [bk.params for bk in mgr.buckets] == before
    mgr.mark_ready(a)
    mgr.mark_ready(b)  # bucket 1 complete, but bucket 0 goes first
    mgr.mark_ready(c)
    assert done == [("complete", 1), ("complete", 0), 0, 1]
    engine = GradientEngine([("a", a), ("b", b), ("c", c)], EngineConfig(plan=[[c], [a, b]], pad_to=2))
    set_bucket_mb(engine, 0.001)
    assert [bk.params for bk in engine.buckets.buckets] == [[c], [a, b]]
    with pytest.raises(ValueError, match="exactly once"):
        GradientEngine([("a", a), ("b", b), ("c", c)], EngineConfig(plan=[[c], [a]]))


def _channels_last():
    """A channels_last CNN under fused AdamW: the gradients left as bucket views keep each weight's
    layout (fused AdamW on CUDA refuses a contiguous gradient of a channels_last weight), and the
    training matches the single-process reference."""
    r, n = px.rank(), px.size()
    torch.manual_seed(0)
    # the second convolution's weight (64*32*3*3) is past VIEW_MIN_NUMEL: its gradient stays a bucket view
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.Flatten(),
                        nn.Linear(64 * 4 * 4, 5))
    ref = copy.deepcopy(net).to(memory_format=torch.channels_last)
    dp = DataParallel(copy.deepcopy(net).to(memory_format=torch.channels_last), bucket_mb=0.05)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2, fused=True)
    layouts = []
    for step in range(4):
        x, y = _batch(step, n * B, (3, 6, 6))
        x = x.contiguous(memory_format=torch.channels_last)
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad(set_to_none=False)  # keep the bucket views as .grad
        nn.functional.cross_entropy(dp(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
        layouts.append(all(p.grad.stride() == p.stride() for p in dp.parameters()))
    return _diff(ref, dp.module), layouts, dp.module[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_channels_last_gradients_keep_the_weight_layout_under_fused_adamw():
    from phalanx.comm.buckets import view_like

    w = torch.empty(8, 3, 3, 3).to(memory_format=torch.channels_last)
    v = view_like(torch.zeros(w.numel()), w)
    assert v.stride() == w.stride() and v.shape == w.shape
    assert view_like(torch.zeros(6), torch.empty(2, 3)).is_contiguous()
    for r, (diff, layouts, still_cl) in enumerate(distributed(_channels_last, np=2)):
        assert diff < TOL, f"rank {r}: {diff}"
        assert layouts == [True] * 4, f"rank {r}: a gradient lost its weight's layout: {layouts}"
        assert still_cl
