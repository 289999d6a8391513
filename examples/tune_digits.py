"""Tune learning rate and batch size of a data-parallel MLP on scikit-learn's digits.

The same training function runs three ways, unchanged:

    phalanx run -np 2 python examples/tune_digits.py --base-lr 0.05 --batch 32     # one job
    python examples/tune_digits.py --optuna --trials 8 --ranks 2                    # Optuna study
    python examples/tune_digits.py --ray-tune --trials 4 --ranks 2                  # Ray Tune + ASHA

The learning rate follows the linear scaling rule (docs/fault_tolerance.md): the searched
``base_lr`` is for a global batch of 32, and each job uses ``base_lr * global_batch / 32``
with ``global_batch = batch * world size``. Validation accuracy is reported every epoch, so
Optuna's MedianPruner and Ray Tune's ASHA can stop poor trials early. The default
configuration (``--base-lr 0.01 --batch 32``) is the study's first trial, for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import phalanx as px

DEFAULT = {"base_lr": 0.01, "batch": 32}
REFERENCE_BATCH = 32


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def train_digits(base_lr: float, batch: int, epochs: int, on_epoch=None) -> float:
    """Every rank: DataParallel training; returns the validation accuracy of the last epoch."""
    px.init()
    rank, size = px.rank(), px.size()
    (xt, yt), (xv, yv) = _data()
    torch.manual_seed(0)
    model = px.DataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    global_batch = batch * size
    lr = base_lr * global_batch / REFERENCE_BATCH
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    acc = 0.0
    for epoch in range(epochs):
        order = torch.randperm(len(xt), generator=torch.Generator().manual_seed(epoch))
        steps = len(xt) // global_batch
        for s in range(steps):
            idx = order[s * global_batch + rank * batch: s * global_batch + (rank + 1) * batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(xv).argmax(1) == yv).float().mean().item()  # same weights on every rank
        if on_epoch is not None:
            on_epoch(epoch, acc)
    return acc


# -- Optuna ------------------------------------------------------------------------------------------

def objective(trial, epochs: int) -> float:
    import optuna

    base_lr = trial.suggest_float("base_lr", 1e-3, 1.0, log=True)
    batch = trial.suggest_categorical("batch", [16, 32, 64])

    def on_epoch(epoch, acc):
        trial.report(acc, epoch)
        if trial.should_prune():  # rank 0 decides, every rank follows
            raise optuna.TrialPruned()

    return train_digits(base_lr, batch, epochs, on_epoch)


def run_optuna(args) -> None:
    import optuna

    from phalanx.tune import run_study, trials_table

    study = run_study(objective, n_trials=args.trials, ranks_per_trial=args.ranks, args=(args.epochs,),
                      study_name=args.study, storage=args.storage, direction="maximize",
                      sampler=optuna.samplers.TPESampler(n_startup_trials=4),
                      pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
                      enqueue=[DEFAULT], slots=args.slots)
    print(trials_table(study, ["base_lr", "batch"]))
    default = study.get_trials()[0]
    best = study.best_trial
    print(f"default {default.params}: {default.value}; best trial {best.number} {best.params}: {best.value:.4f}")


# -- Ray Tune ----------------------------------------------------------------------------------------

def tune_fn(config) -> None:
    from phalanx.tune import report

    train_digits(config["base_lr"], config["batch"], config["epochs"],
                 lambda epoch, acc: report(epoch=epoch + 1, accuracy=acc))


def run_ray_tune(args) -> None:
    import phalanx.ray  # noqa: F401 - before ray: keeps every rank's output lines (docs/ray.md)

    # isort: split
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from phalanx.tune import distributed_trainable

    ray.init(num_cpus=args.slots or None, include_dashboard=False)
    space = {"base_lr": tune.loguniform(1e-3, 1.0), "batch": tune.choice([16, 32, 64]), "epochs": args.epochs}
    tuner = tune.Tuner(
        distributed_trainable(tune_fn, num_workers=args.ranks, cpus_per_worker=1),
        param_space=space,
        tune_config=tune.TuneConfig(num_samples=args.trials, scheduler=ASHAScheduler(
            metric="accuracy", mode="max", time_attr="training_iteration", max_t=args.epochs, grace_period=2,
            reduction_factor=2)),
        run_config=tune.RunConfig(name=args.study, verbose=0, storage_path=args.ray_storage))
    results = tuner.fit()
    print("| trial | base_lr | batch | epochs run | accuracy |\n|---|---|---|---|---|")
    for i, r in enumerate(results):
        print(f"| {i} | {r.config['base_lr']:.4g} | {r.config['batch']} | {r.metrics['epoch']} | "
              f"{r.metrics['accuracy']:.4f} |")
    best = results.get_best_result(metric="accuracy", mode="max")
    print(f"best {best.config['base_lr']:.4g} / {best.config['batch']}: {best.metrics['accuracy']:.4f}")
    ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optuna", action="store_true", help="run an Optuna study of --trials k-rank jobs")
    p.add_argument("--ray-tune", action="store_true", help="run a Ray Tune search with ASHA")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="ranks per trial")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--slots", type=int, default=None, help="ranks that may run at once (default: all cores)")
    p.add_argument("--study", default="tune_digits")
    p.add_argument("--storage", default=None, help="Optuna RDB URL (default sqlite:///<study>.db)")
    p.add_argument("--ray-storage", default=None, help="Ray Tune's results folder")
    p.add_argument("--base-lr", type=float, default=DEFAULT["base_lr"])
    p.add_argument("--batch", type=int, default=DEFAULT["batch"])
    args = p.parse_args()
    if args.optuna:
        run_optuna(args)
    elif args.ray_tune:
        run_ray_tune(args)
    else:  # one job, e.g. under `phalanx run -np 2`
        started = time.perf_counter()
        acc = train_digits(args.base_lr, args.batch, args.epochs,
                           lambda e, a: px.rank() == 0 and print(f"epoch {e}: val acc {a:.4f}"))
        if px.rank() == 0:
            print(f"val acc {acc:.4f} in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
