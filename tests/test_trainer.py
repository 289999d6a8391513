"""Trainer on real ranks: same result as one rank with the same global batch, warm-up values,
bf16 on CPU, and a forced inf that every rank skips."""

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits
from phalanx.testing import distributed
from phalanx.trainer import (
    BroadcastInitialState,
    Callback,
    Checkpoint,
    EarlyStopping,
    LRSchedule,
    LRWarmup,
    TensorBoard,
    Trainer,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


class _RecordLR(Callback):
    def __init__(self):
        self.lrs = []

    def on_step_begin(self, trainer):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


class _InfOnce:
    """A loss that is inf on rank 1 at its 3rd call: every rank must skip that step."""

    def __init__(self):
        self.calls, self.inner = 0, nn.CrossEntropyLoss()

    def __call__(self, out, y):
        self.calls += 1
        loss = self.inner(out, y)
        if px.rank() == 1 and self.calls == 3:
            loss = loss * float("inf")
        return loss


def _fit(per_rank_batch, precision="fp32", inf=False, warmup=False, overlap=False):
    x, y, xt, yt = load_digits()
    model = _model()
    rec = _RecordLR()
    callbacks = [rec] + ([LRWarmup(warmup_epochs=1, scale_by_size=True)] if warmup else [])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      _InfOnce() if inf else nn.CrossEntropyLoss(), (x, y), (xt, yt),
                      batch_size=per_rank_batch, precision=precision, callbacks=callbacks, progress=False,
                      overlap_optimizer=overlap)
    history = trainer.fit(epochs=5 if not warmup else 2)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    pieces = trainer.model.overlap.pieces if trainer.model.overlap is not None else 0
    return history[-1], params, trainer.state.skipped_steps, rec.lrs, trainer.state.step, pieces


def _two_rank_checks():
    plain = _fit(32)
    bf16 = _fit(32, precision="bf16")
    inf = _fit(32, inf=True)
    warm = _fit(32, warmup=True)
    inf16 = _fit(32, precision="fp16", inf=True)  # GradScaler on: both ranks skip and back off alike
    # the optimizer stepped piece by piece during backward: the same parameters, bit for bit
    overlap = _fit(32, overlap=True)
    errors = []
    try:  # a non-finite gradient was already applied: the step cannot be skipped, so it says so
        _fit(32, inf=True, overlap=True)
    except RuntimeError as e:
        errors.append(str(e))
    try:
        _fit(32, precision="fp16", overlap=True)
    except ValueError as e:
        errors.append(str(e))
    return plain, bf16, inf, warm, inf16, (torch.equal(overlap[1], plain[1]), errors, overlap[5])


def test_trainer_on_two_ranks_matches_one_rank_with_the_same_global_batch():
    results = distributed(_two_rank_checks, np=2, timeout=240)
    single = distributed(_fit, np=1, args=(64,))[0]
    (m1, p1, *_), (mb, pb, *_), (mi, pi, skipped, _, steps_inf, _), (_, _, _, lrs, steps, _), _, ov = results[0]
    assert ov[0] and ov[2] > 0, f"Trainer(overlap_optimizer=True): same parameters {ov[0]}, pieces stepped {ov[2]}"
    assert len(ov[1]) == 2 and "already applied" in ov[1][0] and "GradScaler" in ov[1][1], ov[1]
    # same global batch, same updates: the parameters agree with the one-rank run
    torch.testing.assert_close(p1, single[1], atol=1e-4, rtol=1e-4)
    assert abs(m1["val_accuracy"] - single[0]["val_accuracy"]) < 0.01
    assert m1["val_accuracy"] > 0.9
    # bf16 autocast on CPU trains too
    assert mb["val_accuracy"] > 0.85
    # a forced inf on rank 1 made every rank skip exactly one step, and they stayed identical
    assert [r[2][2] for r in results] == [1, 1]
    torch.testing.assert_close(results[0][2][1], results[1][2][1])
    assert [r[4][2] for r in results] == [1, 1] and results[0][4][0]["val_accuracy"] > 0.85  # fp16 + GradScaler
    torch.testing.assert_close(results[0][4][1], results[1][4][1], rtol=0, atol=0)
    # warm-up: lr rises linearly per step from 0.05 to 0.05 * 2 ranks over the first epoch
    steps_per_epoch = steps // 2
    assert abs(lrs[0] - 0.05) < 1e-12
    assert abs(lrs[steps_per_epoch // 2] - (0.05 + 0.05 * (steps_per_epoch // 2) / steps_per_epoch)) < 1e-9
    assert abs(lrs[-1] - 0.1) < 1e-12
    # all ranks agree on the averaged metrics
    assert results[0][0][0] == results[1][0][0]


def _early_stop(log_dir):
    x, y, xt, yt = load_digits()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), (x, y), (xt, yt),
                      batch_size=64, callbacks=[EarlyStopping("val_loss", patience=2), TensorBoard(log_dir)],
                      progress=False)
    return len(trainer.fit(epochs=10)), trainer.state.history


def test_early_stopping_stops_every_rank_at_the_same_epoch_and_rank_0_logs_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # lr=0 means no improvement: patience 2 stops after epoch 3 (1 best + 2 bad)
    results = distributed(_early_stop, np=2, args=(str(tmp_path / "tb"),))
    assert [n for n, _ in results] == [3, 3]
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1  # rank 0 only
    events = EventAccumulator(str(files[0])).Reload()
    logged = [e.value for e in events.Scalars("val_loss")]
    assert logged == pytest.approx([h["val_loss"] for h in results[0][1]], rel=1e-6)


# ---------------------------------------------------------------- resume, accumulation, clipping, recompute

class _Counting(nn.Module):
    """A child that counts its forward calls (activation checkpointing runs it again in backward)."""

    def __init__(self):
        super().__init__()
        self.inner, self.calls = nn.Linear(64, 64), 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _feature_model(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(_Counting(), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10))


def _features_fit(data, epochs, callbacks=(), dropout=0.0, lr=0.05, **kw):
    model = _feature_model(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), data, callbacks=[cb(opt) if callable(cb) else cb
                                                                         for cb in callbacks],
                      progress=False, **{"batch_size": 32, **kw})
    history = trainer.fit(epochs)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), history, trainer, model


def _trainer_features(root):
    x, y, _, _ = load_digits()
    data = (x[:640], y[:640])  # 10 global batches of 64: accumulation splits them evenly
    out = {}
    # auto-resume: 2 epochs, stop, a new trainer continues to 4 == 4 epochs in one go
    sched = lambda opt: LRSchedule(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))  # noqa: E731
    full = _features_fit(data, 4, [sched, Checkpoint(f"{root}/full")], dropout=0.2)
    _features_fit(data, 2, [sched, Checkpoint(f"{root}/cut")], dropout=0.2)
    resumed = _features_fit(data, 4, [sched, Checkpoint(f"{root}/cut")], dropout=0.2)
    out["resume"] = (full[0], resumed[0], full[1], resumed[1], resumed[2].callbacks[-1].resumed_from,
                     resumed[2].optimizer.param_groups[0]["lr"])
    # gradient accumulation: 2 x 16 per rank == 32 per rank
    out["accum"] = (_features_fit(data, 1, batch_size=16, grad_accum=2)[0], _features_fit(data, 1)[0])
    # clipping and activation checkpointing
    out["clip"] = _features_fit(data, 1, max_grad_norm=0.05)[0]
    plain, _, _, m_plain = _features_fit(data, 1)
    ckpt, _, _, m_ckpt = _features_fit(data, 1, activation_checkpointing=True)
    out["recompute"] = (plain, ckpt, m_plain[0].calls, m_ckpt[0].calls)
    # BroadcastInitialState: rank 1 starts with another learning rate; rank 0's wins
    out["broadcast"] = _features_fit(data, 1, [BroadcastInitialState(0)], lr=0.05 * (1 + 9 * px.rank()))[0]
    return out


def test_trainer_resume_accumulation_clipping_and_activation_checkpointing(tmp_path):
    results = distributed(_trainer_features, np=2, args=(str(tmp_path),), timeout=240)
    for out in results:
        full, resumed, h_full, h_resumed, resumed_from, lr = out["resume"]
        assert resumed_from is not None and resumed_from.endswith("step-000000001")
        torch.testing.assert_close(resumed, full, rtol=0, atol=1e-6)  # model, momentum, RNG, scheduler
        assert [h["epoch"] for h in h_resumed] == [0, 1, 2, 3] and h_resumed == h_full
        assert abs(lr - 0.05 * 0.5 ** 4) < 1e-12
        torch.testing.assert_close(out["accum"][0], out["accum"][1], rtol=1e-5, atol=1e-6)
        plain, ckpt, calls_plain, calls_ckpt = out["recompute"]
        torch.testing.assert_close(ckpt, plain, rtol=0, atol=1e-6)
        torch.testing.assert_close(out["broadcast"], plain, rtol=0, atol=1e-6)
        assert calls_ckpt == 2 * calls_plain == 20  # each of the 10 steps recomputed its forward in backward
    torch.testing.assert_close(results[0]["clip"], results[1]["clip"], rtol=0, atol=0)
    # clipping reference: one process, the same global batches of 64, clip the averaged gradient
    x, y, _, _ = load_digits()
    x, y = x[:640], y[:640]
    model = _feature_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = torch.randperm(640, generator=torch.Generator().manual_seed(0))
    for start in range(0, 640, 64):
        idx = order[start:start + 64]
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x[idx]), y[idx]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(results[0]["clip"], ref, rtol=1e-5, atol=1e-6)
    assert (results[0]["clip"] - results[0]["recompute"][0]).abs().max() > 1e-3  # clipping did bite
