"""The training job the elastic tests run: its data, model and step as worker-script text, and the
same job in one process as the reference the workers' final parameters must equal."""

import textwrap

from phalanx import elastic

# Pasted into a worker script that defines TOTAL, G, N_DATA and imports torch and phalanx as px.
# step(..., batch) takes this rank's batch as set by a world-change hook (default G // n).
HELPERS = textwrap.dedent("""
    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N_DATA, 8, generator=g, dtype=torch.float64)
        return x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model, opt, sampler, x, y, n, batch=None):
        batch = G // n if batch is None else batch  # the global batch G is split over the ranks there are
        if sampler.processed >= N_DATA - N_DATA % G:
            sampler.set_epoch(sampler.epoch + 1)
        idx = sampler.indices[:batch]
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        if n > 1:
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
        opt.step()
        sampler.record_batch(batch)
        sampler.reset()
""")


def reference(worker: str, total: int, n_data: int):
    """Run ``worker``'s own model/data/step for ``total`` steps in one process; return (params, model)."""
    ns = {}
    exec(compile(worker, "worker", "exec"), ns)
    model, opt = ns["make"]()
    x, y = ns["data"]()
    sampler = elastic.ElasticSampler(n_data, seed=1, rank=0, world_size=1)
    for _ in range(total):
        ns["step"](model, opt, sampler, x, y, 1)
    return [p.detach() for p in model.parameters()], model


# A whole worker script (run as `python SCRIPT OUT ARGS_JSON`), in the shape of Horovod's elastic
# integration test: epochs of a few batches, a commit every batch, a host list per epoch written
# by rank 0 for the discovery script to print, and failures scheduled by (epoch, batch) on the
# workers of a named host. api "hvd": phalanx.horovod.elastic (TorchState, ObjectState-like extras,
# register_reset_callbacks, ElasticSampler) with hvd.DistributedOptimizer; api "px":
# phalanx.elastic (State, run) with px.DataParallel. Every rank writes its parameters at the end.
JOB = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch

    OUT, ARGS = sys.argv[1], json.loads(sys.argv[2])
    EPOCHS, BATCHES, API = ARGS["epochs"], ARGS["batches"], ARGS["api"]
    SCHEDULE = {int(k): v for k, v in ARGS.get("hosts", {}).items()}   # epoch -> discovery output
    EXITS = ARGS.get("exits", {})   # "epoch,batch" -> [host or worker id, ...]: they fail at that point
    HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
    WID = os.environ.get("PHALANX_ELASTIC_WID", "?")
    START_RANK = os.environ.get("HOROVOD_RANK")   # as a Horovod script reads it at start

    if API == "hvd":
        import phalanx.horovod.torch as hvd
        from phalanx.horovod import elastic as el
        hvd.init()
        rank, size = hvd.rank, hvd.size
    else:
        import phalanx as px
        from phalanx import elastic as el
        px.init()
        rank, size = px.rank, px.size
    from phalanx.elastic import inprocess

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(256, 4, generator=g, dtype=torch.float64)
    Y = torch.randn(256, 2, generator=g, dtype=torch.float64)
    if API == "hvd":
        model, opt = net, hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters())
        sampler = el.ElasticSampler(list(range(256)), shuffle=True, seed=3)
        state = el.TorchState(net, inner, sampler=sampler, epoch=0, batch=0, resets=0, commit_dir=OUT + "/c")
        state.register_reset_callbacks([lambda: setattr(state, "resets", state.resets + 1)])
    else:
        model, opt = px.DataParallel(net), inner
        sampler = el.ElasticSampler(256, shuffle=True, seed=3)
        state = el.TorchState(net, inner, sampler=sampler, epoch=0, batch=0, commit_dir=OUT + "/c")

    def log(what, **kw):
        with open(os.path.join(OUT, "log.jsonl"), "a") as f:
            f.write(json.dumps({"what": what, "wid": WID, "host": HOST, "pid": os.getpid(), "rank": rank(),
                                "size": size(), "gen": inprocess.generation(), "t": time.time(), **kw}) + "\\n")

    def maybe_fail(epoch, batch):
        # "epoch,batch": fail there ("admitting": see commit())
        due = EXITS.get(f"{epoch},{batch}", [])
        fail_now(due, epoch, batch)

    def fail_now(due, epoch, batch):
        for entry in due:   # "kill:NAME": by SIGKILL, "stop:NAME": SIGSTOP (frozen), else by an exception
            mode, _, name = entry.rpartition(":")
            if name not in (HOST, WID):
                continue
            log("fail", epoch=epoch, batch=batch, mode=mode or "exception")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError(f"scheduled failure at epoch {epoch} batch {batch} on {HOST} ({WID})")

    def commit(epoch, batch):
        # "admitting": fail at the first commit that admits newcomers, while their generation forms
        try:
            state.commit()
        except inprocess.MembershipChanged:
            grown = len(inprocess.members_of(inprocess.latest_generation())) > size()
            if grown and not os.path.exists(OUT + "/admit." + WID):
                open(OUT + "/admit." + WID, "w").close()   # (once per worker)
                fail_now(EXITS.get("admitting", []), epoch, batch)
            raise

    def wait_for_joiners():
        # rank 0, at the end of an epoch: below ARGS["size"], wait (bounded) for the launcher to admit more
        deadline = time.time() + 120
        while size() < ARGS.get("size", 0) and inprocess.latest_generation() <= inprocess.generation():
            if time.time() > deadline:
                return
            time.sleep(0.02)

    def change_hosts(epoch):
        # rank 0, at the end of an epoch: the next epoch's hosts, and wait (bounded) for the launcher
        nxt = SCHEDULE.get(epoch + 1)
        if nxt is None or nxt == SCHEDULE.get(epoch):
            return
        with open(os.path.join(OUT, "hosts.txt"), "w") as f:
            f.write(nxt)
        deadline = time.time() + ARGS.get("change_wait", 90)
        while inprocess.latest_generation() <= inprocess.generation():
            if time.time() > deadline:
                if ARGS.get("change_wait"):
                    return   # (random test: a change may leave the membership as it is)
                raise TimeoutError("the launcher published no new generation within 90 s")
            time.sleep(0.02)

    @el.run
    def train(state):
        log("start", epoch=state.epoch, batch=state.batch, start_rank=START_RANK)
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                maybe_fail(state.epoch, state.batch)
                idx = state.sampler.indices[:4]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
                opt.step()
                state.sampler.record_batch(state.batch, 4) if API == "hvd" else state.sampler.record_batch(4)
                state.batch += 1
                commit(state.epoch, state.batch)
            if rank() == 0:
                log("epoch", epoch=state.epoch)
                change_hosts(state.epoch)
                wait_for_joiners()
            state.epoch, state.batch = state.epoch + 1, 0
            state.sampler.set_epoch(state.epoch)
            commit(state.epoch, state.batch)

    train(state)
    log("end", epoch=state.epoch, resets=state.resets if API == "hvd" else None)
    torch.save([p.detach() for p in net.parameters()], os.path.join(OUT, f"params.{rank()}.pt"))
''')


# An elastic job for preemption (`python SCRIPT OUT MODE TOTAL`, under `phalanx run --min-np`): every
# rank takes the gradient of the same batch, so the average of the two is bitwise the one-process
# gradient and `preempt_reference` is the uninterrupted run. MODE "first": rank 0 writes OUT/waiting
# after commit 3 and waits for its preemption signal; every rank notes where it stopped.
PREEMPT_JOB = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic
    from phalanx.preemption import Preempted, signals

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g, dtype=torch.float64)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), x, x.sum(1, keepdim=True).sin()

    def step(model, opt, x, y, i, n):
        idx = slice(8 * (i % 8), 8 * (i % 8) + 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        if n > 1:
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
        opt.step()

    if __name__ == "__main__":
        OUT, MODE, TOTAL = sys.argv[1], sys.argv[2], int(sys.argv[3])
        px.init()
        model, opt, x, y = make()
        # a file every 3rd commit: the preemption's commit (the 4th) is written because it is one
        state = elastic.TorchState(model, opt, step=0, snapshot_every=3)

        @elastic.run
        def train(state):
            while state.step < TOTAL:
                step(model, opt, x, y, state.step, px.size())
                state.step += 1
                state.commit()
                if MODE == "first" and state.step == 3 and px.rank() == 0:
                    open(os.path.join(OUT, "waiting"), "w").close()
                    deadline = time.monotonic() + 120
                    while signals.received() is None and time.monotonic() < deadline:
                        time.sleep(0.01)

        try:
            train(state)
        except Preempted as stop:
            with open(os.path.join(OUT, f"stop.{px.rank()}.json"), "w") as f:
                json.dump({"step": state.step, "path": stop.path, "code": stop.code}, f)
            raise
        torch.save([p.detach() for p in model.parameters()], os.path.join(OUT, f"params.{px.rank()}.pt"))
''')


def preempt_reference(total: int):
    """PREEMPT_JOB's model after ``total`` uninterrupted steps in one process."""
    ns = {"__name__": "reference"}
    exec(compile(PREEMPT_JOB, "preempt_job", "exec"), ns)
    model, opt, x, y = ns["make"]()
    for i in range(total):
        ns["step"](model, opt, x, y, i, 1)
    return [p.detach() for p in model.parameters()]
