"""The job tests/services/test_preempt.py runs under ``phalanx run -np 2``: a plain loop, then a Trainer.

    python preempt_job.py OUT first     # references, then both jobs preempted (plain: a self-sent
                                        # SIGTERM on rank 0 only; Trainer: the test's USR1 to phalanx run)
    python preempt_job.py OUT resume    # SLURM_RESTART_COUNT=1: both resume and finish
    srun python preempt_job.py OUT slurm     # the plain loop in an sbatch --requeue job: the first run
                                        # waits at step 7 for the test's scancel --signal=USR1 --full,
                                        # the requeued run (SLURM_RESTART_COUNT=1) resumes and finishes

Each rank writes OUT/<what>.<rank>.json (its stop step) and OUT/<what>.pt (rank 0's final parameters).
"""

import json
import os
import sys
import time

import torch

import phalanx as px
from phalanx.checkpoint import CheckpointManager, RNGState
from phalanx.preemption import Preempted, signals
from phalanx.trainer import Callback, Checkpoint, Trainer

STEPS, EPOCHS, WAIT_STEP = 12, 3, 7
out, phase = sys.argv[1], sys.argv[2]


def note(what, **info):
    with open(os.path.join(out, f"{what}.{px.rank()}.json"), "w") as f:
        json.dump(info, f)


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def plain(root, preemptible):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "optim": opt, "rng": RNGState(), "step": 0}
    mgr = CheckpointManager(root)
    resumed = None
    with px.preemption.watch() as preempt:
        if preemptible:
            resumed = preempt.resume(mgr, state)
        for step in range(state["step"], STEPS):
            g = torch.Generator().manual_seed(100 * step + px.rank())
            x = torch.randn(16, 6, generator=g)
            loss = (model(x) + torch.randn(16, 1) * 0.01 - x[:, :1]).pow(2).mean()  # randn: global RNG is saved
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
            opt.step()
            state["step"] = step + 1
            if preemptible and phase == "first" and step == 4 and px.rank() == 0:
                os.kill(os.getpid(), 15)  # this rank only; the other never gets a signal
            if preemptible and phase == "slurm" and step == WAIT_STEP and not resumed and px.rank() == 0:
                wait_for_signal()
            if preemptible and preempt.requested():
                try:
                    preempt.save_and_exit(mgr, state["step"], state)
                except Preempted as e:
                    note("plain_stop", step=state["step"], path=e.path, code=e.code, requeued=e.requeued)
                    if phase == "slurm":
                        raise
                    signals.clear()
                    return None
    return model


def wait_for_signal():
    """Tell the test this rank is inside a step, then wait there until the preemption signal came."""
    open(os.path.join(out, "waiting"), "w").close()
    deadline = time.monotonic() + 120
    while signals.received() is None and time.monotonic() < deadline:
        time.sleep(0.01)


class WaitForSignal(Callback):
    """Rank 0 stops inside step WAIT_STEP until its preemption signal came (the test sends it)."""

    def on_step_end(self, trainer):
        if trainer.state.step == WAIT_STEP and px.rank() == 0:
            wait_for_signal()


def trainer(root, callbacks):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.nn.CrossEntropyLoss(),
                train_data=(x, y), batch_size=8, progress=False, callbacks=callbacks)
    t.fit(EPOCHS)
    return model, t


px.init()
if phase == "first":
    torch.save(params(plain(os.path.join(out, "unused"), False)), os.path.join(out, "plain_ref.pt"))
    model, t = trainer(None, [])
    note("trainer_ref", history=t.state.history)
    torch.save(params(model), os.path.join(out, "trainer_ref.pt"))
    plain(os.path.join(out, "plain_ckpt"), True)
    try:
        trainer(None, [WaitForSignal(), Checkpoint(os.path.join(out, "trainer_ckpt"))])
    except Preempted as e:
        note("trainer_stop", path=e.path, signal=e.signal.name if e.signal else None)
        raise
    note("trainer_stop", path=None)  # not preempted: the test fails on it
elif phase == "slurm":
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":  # the first run makes the reference
        reference = params(plain(os.path.join(out, "unused"), False))
        if px.rank() == 0:
            torch.save(reference, os.path.join(out, "plain_ref.pt"))
    model = plain(os.path.join(out, "plain_ckpt"), True)
    note("slurm_done", restart=os.environ.get("SLURM_RESTART_COUNT"))
    if px.rank() == 0:
        torch.save(params(model), os.path.join(out, "plain_resumed.pt"))
else:
    model = plain(os.path.join(out, "plain_ckpt"), True)
    if px.rank() == 0:
        torch.save(params(model), os.path.join(out, "plain_resumed.pt"))
    model, t = trainer(None, [Checkpoint(os.path.join(out, "trainer_ckpt"))])
    note("trainer_resumed", history=t.state.history, resumed=t.callbacks[-1].resumed_from)
    if px.rank() == 0:
        torch.save(params(model), os.path.join(out, "trainer_resumed.pt"))
