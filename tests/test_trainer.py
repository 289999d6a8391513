"""Trainer on real ranks: same result as one rank with the same global batch, warm-up values,
bf16 on CPU, and a forced inf that every rank skips."""

import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits
from phalanx.testing import distributed
from phalanx.trainer import Callback, EarlyStopping, LRWarmup, Trainer


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


def _fit(per_rank_batch, precision="fp32", inf=False, warmup=False):
    x, y, xt, yt = load_digits()
    model = _model()
    rec = _RecordLR()
    callbacks = [rec] + ([LRWarmup(warmup_epochs=1, scale_by_size=True)] if warmup else [])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      _InfOnce() if inf else nn.CrossEntropyLoss(), (x, y), (xt, yt),
                      batch_size=per_rank_batch, precision=precision, callbacks=callbacks, progress=False)
    history = trainer.fit(epochs=5 if not warmup else 2)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return history[-1], params, trainer.state.skipped_steps, rec.lrs, trainer.state.step


def _two_rank_checks():
    plain = _fit(32)
    bf16 = _fit(32, precision="bf16")
    inf = _fit(32, inf=True)
    warm = _fit(32, warmup=True)
    return plain, bf16, inf, warm


def test_trainer_on_two_ranks_matches_one_rank_with_the_same_global_batch():
    results = distributed(_two_rank_checks, np=2, timeout=240)
    single = distributed(_fit, np=1, args=(64,))[0]
    (m1, p1, _, _, _), (mb, pb, _, _, _), (mi, pi, skipped, _, steps_inf), (_, _, _, lrs, steps) = results[0]
    # same global batch, same updates: the parameters agree with the one-rank run
    torch.testing.assert_close(p1, single[1], atol=1e-4, rtol=1e-4)
    assert abs(m1["val_accuracy"] - single[0]["val_accuracy"]) < 0.01
    assert m1["val_accuracy"] > 0.9
    # bf16 autocast on CPU trains too
    assert mb["val_accuracy"] > 0.85
    # a forced inf on rank 1 made every rank skip exactly one step, and they stayed identical
    assert [r[2][2] for r in results] == [1, 1]
    torch.testing.assert_close(results[0][2][1], results[1][2][1])
    # warm-up: lr rises linearly per step from 0.05 to 0.05 * 2 ranks over the first epoch
    steps_per_epoch = steps // 2
    assert abs(lrs[0] - 0.05) < 1e-12
    assert abs(lrs[steps_per_epoch // 2] - (0.05 + 0.05 * (steps_per_epoch // 2) / steps_per_epoch)) < 1e-9
    assert abs(lrs[-1] - 0.1) < 1e-12
    # all ranks agree on the averaged metrics
    assert results[0][0][0] == results[1][0][0]


def _early_stop():
    x, y, xt, yt = load_digits()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss(), (x, y), (xt, yt),
                      batch_size=64, callbacks=[EarlyStopping("val_loss", patience=2)], progress=False)
    return len(trainer.fit(epochs=10))


def test_early_stopping_stops_every_rank_at_the_same_epoch():
    # lr=0 means no improvement: patience 2 stops after epoch 3 (1 best + 2 bad)
    assert distributed(_early_stop, np=2) == [3, 3]
