"""A Horovod elastic training script run unchanged under ``phalanx run`` (tests/fronts/test_horovod_elastic_flow.py).

It follows the flow Horovod's elastic integration tests drive (their ``elastic_torch_main.py`` and the
rows ``elastic_common.py`` asserts); written for phalanx, its flags are theirs:

    hvd.init() ─ TorchState(model, DistributedOptimizer, sampler, batch=0, epoch=0, commits=0, rendezvous=0)
    train(state), under hvd.elastic.run:  rendezvous += 1
        each batch: maybe exit (--exit-schedule, by the rank the worker started with) ─ step on the
            ElasticSampler's next samples (noted in --indices-dir) ─ record_batch ─ commit
        end of epoch, rank 0: one JSON row to --logfile; when --discovery-schedule changes the hosts
            for the next epoch (or --notice-after names the epoch: a host back from its cooldown),
            wait (≤ --discovery-wait s) until state._host_messages is not empty
        epoch += 1 ─ commit (this commit raises on every rank when the hosts changed)

    every commit: ``except hvd.elastic.HostsUpdatedInterrupt`` notes [class name, skip_sync] (the row's
    "caught": what this process caught so far) and re-raises, as a Horovod user's script would

The discovery script the test writes reads the logfile's row count as the epoch, so the hosts change
exactly when rank 0 has logged an epoch. Ours, not Horovod's: ``--params-dir`` saves every rank's parameters
at the end, ``--indices-dir`` and ``--notice-after`` as above.
"""

import argparse
import json
import os
import signal
import time

import torch

import phalanx.horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod's elastic flow through phalanx run")
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--logfile", required=True, help="one JSON row per epoch, written by rank 0")
parser.add_argument("--discovery-schedule", default="[]",
                    help="JSON [[epoch or null, ['host:slots', ...]], ...]: the hosts of each epoch (null: the rest)")
parser.add_argument("--discovery-wait", type=int, default=3,
                    help="seconds rank 0 waits for the launcher's notice of an expected host change (<= 0: no wait)")
parser.add_argument("--notice-after", default="[]",
                    help="JSON [epochs]: after logging these, rank 0 also waits (<= --discovery-wait s) for a notice "
                         "(a host back from its cooldown)")
parser.add_argument("--exit-schedule", default="{}",
                    help='JSON {"(epoch, batch)": [start ranks]}: those workers exit there')
parser.add_argument("--exit-mode", default="exception", choices=["exception", "kill"])
parser.add_argument("--params-dir", default=None, help="save each rank's final parameters here")
parser.add_argument("--indices-dir", default=None,
                    help="each worker appends the sample indices of each step it took to idx.<pid>.jsonl here")
args = parser.parse_args()

hvd.init()
HOSTNAME = os.environ.get("HOROVOD_HOSTNAME")
START_RANK = int(os.environ.get("HOROVOD_RANK", "0"))  # the rank this worker was started as

schedule = json.loads(args.discovery_schedule)
HOSTS = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
REST = schedule[-1][1] if schedule else []
EXITS = json.loads(args.exit_schedule or "{}")
NOTICE_AFTER = set(json.loads(args.notice_after))
CAUGHT = []  # [class name, skip_sync] of each HostsUpdatedInterrupt this process caught at a commit

BASE_LR = 0.001
torch.manual_seed(START_RANK)  # replicas differ until state.sync() gives every rank rank 0's
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
features = torch.randn(32, 2)
labels = torch.randint(0, 2, (32,))
LOCAL_BATCH = 2  # samples per rank and step, dealt by the ElasticSampler (4 ranks x 2 batches: half an epoch)
sampler = hvd.elastic.ElasticSampler(torch.utils.data.TensorDataset(features, labels), shuffle=True, seed=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size()),
                                     named_parameters=model.named_parameters())


def hosts_of(epoch):
    return HOSTS.get(epoch, REST)


def exit_if_scheduled(epoch, batch):
    if START_RANK not in EXITS.get(str((epoch, batch)), []):
        return
    if args.exit_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"scheduled exit at epoch {epoch} batch {batch}: started as rank {START_RANK}, "
                       f"now rank {hvd.rank()}")


def log_epoch(state):
    row = {"epoch": state.epoch, "batch": state.batch, "commits": state.commits, "hostname": HOSTNAME,
           "start_rank": START_RANK, "rank": hvd.rank(), "size": hvd.size(), "rendezvous": state.rendezvous,
           "caught": CAUGHT}
    with open(args.logfile, "a") as f:
        f.write(json.dumps(row) + "\n")


def wait_for_host_notice(state, epoch):
    """Rank 0, after logging ``epoch``: the hosts of the next epoch differ (or a host returns), so the
    launcher must tell us."""
    if args.discovery_wait <= 0 or (hosts_of(epoch) == hosts_of(epoch + 1) and epoch not in NOTICE_AFTER):
        return None
    began = time.time()
    while state._host_messages.empty():
        if time.time() - began > args.discovery_wait:
            raise TimeoutError(f"no host-change notice within {args.discovery_wait}s after epoch {epoch}")
        time.sleep(0.1)
    return round(time.time() - began, 2)


def note_indices(state, idx):
    """The step just taken (committed next, so never rolled back): which samples, in which epoch."""
    if args.indices_dir:
        with open(os.path.join(args.indices_dir, f"idx.{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": state.epoch, "batch": state.batch, "size": hvd.size(), "idx": idx}) + "\n")


def commit(state):
    """A Horovod user's ``except hvd.elastic.HostsUpdatedInterrupt`` around a commit: noted, re-raised."""
    try:
        state.commit()
    except hvd.elastic.HostsUpdatedInterrupt as err:
        CAUGHT.append([type(err).__name__, err.skip_sync])
        raise


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    at = 0  # position in this rank's share of the epoch's rest, dealt again at every reset (sync)
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            exit_if_scheduled(state.epoch, state.batch)
            idx = state.sampler.indices[at:at + LOCAL_BATCH]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(features[idx]), labels[idx]).backward()
            optimizer.step()
            note_indices(state, idx)
            at += LOCAL_BATCH
            state.sampler.record_batch(state.batch, LOCAL_BATCH)
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commits += 1
                commit(state)
        if hvd.rank() == 0:
            log_epoch(state)
            waited = wait_for_host_notice(state, state.epoch)
            if waited is not None:
                print(f"host-change notice {waited:.2f}s after epoch {state.epoch} was logged", flush=True)
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        at = 0
        state.commits += 1
        commit(state)


def rescale_lr():
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, batch=0, epoch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([rescale_lr])
train(state)
if args.params_dir:
    torch.save([p.detach() for p in model.parameters()], os.path.join(args.params_dir, f"params.{hvd.rank()}.pt"))
