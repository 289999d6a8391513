"""Trainer on real ranks: same result as one rank with the same global batch, warm-up values,
bf16 on CPU, a forced inf that every rank skips; metrics averaged before any callback; every
data form (tensors, Dataset of dicts, IterableDataset, DataLoader) against a one-process
reference; refused input; progress lines and the README script under `phalanx run`."""

import os
import re
import textwrap
import warnings

import pytest
import torch
from scripts_job import run_scripts
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

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
from phalanx.trainer.data import DataError

pytestmark = pytest.mark.ranks


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
    # the training loss too is the ranks' average (each rank's shard gives its own loss)
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([h["loss"] for h in results[0][1]], rel=1e-6)
    assert results[0][1] == results[1][1]


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
    if px.rank() == 0:  # the newest as earlier versions named it: still found and read
        os.rename(f"{root}/cut/epoch-000000001", f"{root}/cut/step-000000001")
    px.barrier()
    resumed = _features_fit(data, 4, [sched, Checkpoint(f"{root}/cut")], dropout=0.2)
    out["resume"] = (full[0], resumed[0], full[1], resumed[1], resumed[2].callbacks[-1].resumed_from,
                     resumed[2].optimizer.param_groups[0]["lr"],
                     sorted(os.listdir(f"{root}/cut")) if px.rank() == 0 else None)  # rank 0 prunes
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
        full, resumed, h_full, h_resumed, resumed_from, lr, kept = out["resume"]
        assert resumed_from is not None and resumed_from.endswith("step-000000001")
        assert kept in (None, ["epoch-000000002", "epoch-000000003", "step-000000001"])  # by epoch, newest 3
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


# ---------------------------------------------------------------- metrics averaged before any callback sees them

class _RankLoss:
    """A loss whose value depends only on (rank, epoch): the ranks see different losses."""

    def __init__(self, table):
        self.table, self.trainer = table, None

    def __call__(self, out, y):
        return out.sum() * 0 + self.table[px.rank()][self.trainer.state.epoch]


class _Seen(Callback):
    def __init__(self, stop_rank0_at=None):
        self.seen, self.stop_rank0_at = [], stop_rank0_at

    def on_epoch_end(self, trainer):
        self.seen.append(trainer.state.metrics["loss"])
        if px.rank() == 0 and trainer.state.epoch == self.stop_rank0_at:
            trainer.state.stop = True  # one rank's own decision: every rank must still stop together


def _uneven_losses():
    x, y, _, _ = load_digits()
    runs = {}
    cases = {
        # rank 0 alone would stop after epoch 1 (no gain); the average gains 0.5 an epoch: no stop
        "improving": ([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, -1.0, -2.0]], None),
        # rank 1 alone improves by 0.3; the average gains less than min_delta: both stop after epoch 1
        "flat": ([[1.0, 1.0, 1.0, 1.0], [1.3, 1.0, 1.0, 1.0]], None),
        # a user callback stops rank 0 only, at epoch 2: every rank stops there
        "one rank stops": ([[1.0, 0.0, -1.0, -2.0], [1.0, 0.0, -1.0, -2.0]], 2),
    }
    for name, (table, stop_at) in cases.items():
        model = _model()
        loss = _RankLoss(table)
        seen = _Seen(stop_at)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), loss, (x[:256], y[:256]),
                          batch_size=32, callbacks=[seen, EarlyStopping("loss", patience=1, min_delta=0.21)],
                          progress=False)
        loss.trainer = trainer
        runs[name] = (len(trainer.fit(epochs=4)), seen.seen)
    return runs


def test_metrics_are_averaged_before_user_callbacks_and_every_rank_stops_together():
    results = distributed(_uneven_losses, np=2, timeout=240)
    for runs in results:
        assert runs["improving"] == (4, pytest.approx([1.0, 0.5, 0.0, -0.5])), runs["improving"]
        assert runs["flat"] == (2, pytest.approx([1.15, 1.0])), runs["flat"]
        assert runs["one rank stops"][0] == 3, runs["one rank stops"]


# ---------------------------------------------------------------- data: every form, against one process

class _DictSamples(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]}


class _Stream(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y, self.epochs = x, y, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(zip(self.x, self.y))


def _stack_pairs(items):
    return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fit_data(data, epochs=2, model=None, loss=None, **kw):
    model = model or _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss or nn.CrossEntropyLoss(),
                      data, progress=False, **kw)
    trainer.fit(epochs)
    return _params(model), trainer


def _data_forms():
    x, y, _, _ = load_digits()
    x, y = x[:640], y[:640]
    out = {"tensors": _fit_data((x, y), batch_size=32)[0]}
    user = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, num_workers=1, pin_memory=False,
                      collate_fn=_stack_pairs)
    params, trainer = _fit_data(user)
    kept = trainer.train_loader.loader
    out["loader"] = (params, kept.num_workers, kept.collate_fn is user.collate_fn, len(kept))
    out["dicts"] = _fit_data(_DictSamples(x, y), batch_size=32)[0]
    stream = _Stream(x, y)
    out["iterable"] = (_fit_data(stream, batch_size=32)[0], stream.epochs)
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=px.size(), rank=px.rank(), seed=0)
    out["sharded"] = (_fit_data(DataLoader(TensorDataset(x, y), batch_size=32, sampler=sampler))[0], sampler.epoch)
    # [N, 1] targets stay [B, 1]; [N] targets against a [B, 1] output are named in a warning
    reg = nn.Linear(64, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_data((x, y.float()[:, None]), epochs=1, model=reg, loss=nn.MSELoss(), batch_size=32)
        out["column"] = [str(w.message) for w in caught if "broadcast" in str(w.message)]
        _fit_data((x, y.float()), epochs=1, model=nn.Linear(64, 1), loss=nn.MSELoss(), batch_size=32)
        out["flat"] = [str(w.message) for w in caught if "Trainer:" in str(w.message)]
    errors = {}
    for name, data, kw in [("list", [x, y], {}), ("small", (x[:40], y[:40]), {"batch_size": 32}),
                           ("batch_size", (x, y), {"batch_size": "32"}), ("precision", (x, y), {"precision": "fp8"}),
                           ("tuple", (x, y, y), {}), ("lengths", (x, y[:10]), {}), ("dict keys", [{"a": 1}] * 64, {}),
                           ("loader batch", user, {"batch_size": 16}), ("object", object(), {})]:
        try:
            _fit_data(data, epochs=1, **kw)
            errors[name] = None
        except (DataError, ValueError) as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def _reference(shuffle):
    x, y, _, _ = load_digits()
    return _fit_data((x[:640], y[:640]), batch_size=64, shuffle=shuffle)[0]


def test_trainer_trains_the_same_on_every_data_form_as_one_process_on_tensors():
    results = distributed(_data_forms, np=2, timeout=300)
    ref_shuffled, ref_in_order = distributed(_reference, np=1, args=(True,))[0], \
        distributed(_reference, np=1, args=(False,))[0]
    for out in results:
        close = dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out["tensors"], ref_shuffled, **close)
        params, workers, own_collate, batches = out["loader"]
        torch.testing.assert_close(params, ref_shuffled, **close)  # re-sharded, shuffled as one process would
        assert (workers, own_collate, batches) == (1, True, 10)  # the user's settings kept; 640 / 2 / 32
        torch.testing.assert_close(out["dicts"], ref_shuffled, **close)  # {"image", "label"} samples
        torch.testing.assert_close(out["iterable"][0], ref_in_order, **close)  # every 2nd item: in-order batches
        assert out["iterable"][1] == [0, 1]  # set_epoch reached the IterableDataset
        torch.testing.assert_close(out["sharded"][0], ref_shuffled, **close)  # the user's own sampler
        assert out["sharded"][1] == 1  # set_epoch called each epoch
        assert out["column"] == [] and len(out["flat"]) == 1 and "[32, 1]" in out["flat"][0] \
            and "[32]" in out["flat"][0] and "[32, 32]" in out["flat"][0], out["flat"]
        e = out["errors"]
        assert "TensorDataset" in e["list"] and "tuple" in e["list"], e["list"]
        assert "40 samples, fewer than one global batch" in e["small"] and "= 64" in e["small"], e["small"]
        assert "Trainer(batch_size='32')" in e["batch_size"], e["batch_size"]
        assert "Trainer(precision='fp8')" in e["precision"] and "bf16" in e["precision"], e["precision"]
        assert "must be (inputs, targets)" in e["tuple"], e["tuple"]
        assert "same number of samples" in e["lengths"], e["lengths"]
        assert "split_batch" in e["dict keys"] and "['a']" in e["dict keys"], e["dict keys"]
        assert "batch_size 32" in e["loader batch"], e["loader batch"]
        assert "is a object" in e["object"] and "Dataset" in e["object"], e["object"]
        assert all("\n" not in m for m in e.values())


# ---------------------------------------------------------------- checkpoints: a named resume must exist; no stale prune

def _checkpoint_refusals(root):
    x, y, _, _ = load_digits()
    data, out = (x[:256], y[:256]), {}
    os.environ["PHALANX_RESUME_FROM"] = f"{root}/typo"
    try:
        _fit_data(data, 1, batch_size=32, callbacks=[Checkpoint(f"{root}/a")])
    except ValueError as e:
        out["missing"] = str(e)
    finally:
        del os.environ["PHALANX_RESUME_FROM"]
    os.environ["PHALANX_RESUME_FROM"] = f"{root}/own"  # the callback's own directory: the first start
    try:
        out["own"] = len(_fit_data(data, 1, batch_size=32, callbacks=[Checkpoint(f"{root}/own")])[1].state.history)
    finally:
        del os.environ["PHALANX_RESUME_FROM"]
    _fit_data(data, 3, batch_size=32, callbacks=[Checkpoint(f"{root}/old")])  # an earlier run: epochs 0-2
    try:
        _fit_data(data, 2, batch_size=32, callbacks=[Checkpoint(f"{root}/old", resume=False)])
    except ValueError as e:
        out["stale"] = str(e)
    return out


def test_resume_from_a_missing_directory_and_a_directory_of_a_newer_run_are_refused(tmp_path):
    for out in distributed(_checkpoint_refusals, np=2, args=(str(tmp_path),), timeout=240):
        assert "PHALANX_RESUME_FROM=" in out["missing"] and "typo" in out["missing"] \
            and "is not a directory" in out["missing"], out
        assert out["own"] == 1, out
        assert "epoch-000000002" in out["stale"] and "new directory" in out["stale"], out
    assert not (tmp_path / "a").exists()  # nothing trained, nothing written


# ---------------------------------------------------------------- under `phalanx run`: progress lines, the README script

_TRAIN_SCRIPT = """
import torch, phalanx as px
from phalanx.demo import load_digits
px.init()
x, y, xt, yt = load_digits()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
trainer = px.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
                     (x, y), (xt, yt), batch_size=32, log_every=10)
trainer.fit(2)
px.print0("done")
"""


@pytest.fixture(scope="module")
def phalanx_run_scripts(tmp_path_factory):
    """Both scripts in one `phalanx run -np 2` job (scripts_job.py): (the job, {script: its output lines})."""
    tmp_path = tmp_path_factory.mktemp("phalanx_run_scripts")
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    scripts = {"train.py": _TRAIN_SCRIPT, "readme_train.py": re.search(r"```python\n(# train.py.*?)```", readme, re.S).group(1)}
    for name, code in scripts.items():
        (tmp_path / name).write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    return run_scripts(tmp_path, [tmp_path / n for n in scripts], timeout=300, env=env, cwd=tmp_path)


def test_progress_under_phalanx_run_is_a_line_per_epoch_from_rank_0(phalanx_run_scripts):
    out, sections = phalanx_run_scripts
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sections.get("train.py", "").splitlines()
    epochs = [ln for ln in lines if re.match(r"\[0\]: epoch \d/2: loss ", ln)]
    assert len(epochs) == 2, out.stdout
    assert all("val_accuracy" in ln and "samples/s" in ln for ln in epochs), epochs
    assert any(re.match(r"\[0\]: epoch 1 batch 10/\d+: loss .* samples/s", ln) for ln in lines), out.stdout
    assert not any(ln.startswith("[1]:") for ln in lines), out.stdout  # rank 0 only
    assert "%|" not in out.stdout + out.stderr  # no bar redraws in a log
    assert "[0]: done" in lines


def test_readme_minimal_script_runs_under_phalanx_run(phalanx_run_scripts):
    out, sections = phalanx_run_scripts
    code = open(out.args[-1]).read()
    assert "DistributedSampler" in code and "set_epoch" in code
    assert out.returncode == 0, out.stderr[-3000:]
    text = sections.get("readme_train.py", "")
    losses = [float(m) for m in re.findall(r"^\[0\]: epoch \d: loss ([\d.]+)$", text, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    assert not any(ln.startswith("[1]:") for ln in text.splitlines()), out.stdout


class _FakeTerminal:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_progress_is_a_live_bar_on_a_terminal_and_lines_elsewhere_and_silent_off_rank_0():
    from phalanx.trainer.progress import Progress

    shown = {}
    for name, tty, rank in [("terminal", True, 0), ("pipe", False, 0), ("rank 1", True, 1)]:
        stream = _FakeTerminal(tty)
        p = Progress(enabled=True, rank=rank, size=2, log_every=2, stream=stream)
        p.epoch_begin(0, 3, 4)
        for _ in range(4):
            p.batch(32, 0.5)
        p.train_end()
        p.epoch_end({"loss": 0.5, "val_loss": 0.25})
        shown[name] = stream.text
    assert "\r" in shown["terminal"] and "epoch 1/3" in shown["terminal"]  # tqdm redraws in place
    lines = shown["pipe"].splitlines()
    assert "\r" not in shown["pipe"] and len(lines) == 3, lines  # batch 2, batch 4, the epoch
    assert lines[0].startswith("epoch 1 batch 2/4: loss 0.5000 (rank 0) | ") and lines[0].endswith("samples/s")
    assert lines[2].startswith("epoch 1/3: loss 0.5000 | val_loss 0.2500 | ") and "samples/s" in lines[2]
    assert shown["rank 1"] == ""
