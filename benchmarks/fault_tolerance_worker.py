"""The job every runner of benchmarks/fault_tolerance.py runs (that script reads this file as text and
writes it into each run's folder; its docstring says what the job does under each runner)."""
import json
import os
import sys
import time

BOOT = time.time()   # the interpreter is up; imports next (the "boot" row times a replacement's start)
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

IMPORTED = time.time()

OUT, MODE, A = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
N, G = 256, A["batch"]
gen = torch.Generator().manual_seed(1)
X = torch.randn(N, 16, 64, generator=gen)
Y = torch.randint(0, 10, (N,), generator=gen)

def make():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Flatten(),
                         nn.Linear(64 * 16, 10))

def batch(step, r, n):
    idx = torch.arange(step * G, step * G + G) % N
    part = idx[r * G // n:(r + 1) * G // n]
    return X[part], Y[part]

def optimizer(m):
    return torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)

def stop_at():
    try:
        with open(OUT + "/stop") as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return A["steps"]

def log(what, **kw):
    with open(OUT + "/log.jsonl", "a") as f:
        f.write(json.dumps({"what": what, "t": time.time(), "pid": os.getpid(), **kw}) + "\n")

def check_raise(step):
    if os.path.exists(f"{OUT}/raise.{os.getpid()}"):
        os.unlink(f"{OUT}/raise.{os.getpid()}")
        raise RuntimeError(f"fault_tolerance: injected failure in pid {os.getpid()} at step {step}")

def boot():
    """When this process was made, its interpreter was up, torch imported, and the job joined (now)."""
    with open(f"/proc/{os.getpid()}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    log("boot", made=btime + ticks / os.sysconf("SC_CLK_TCK"), python=BOOT, torch=IMPORTED)

def save(params):
    torch.save([p.detach().clone() for p in params], f"{OUT}/params.{os.getpid()}.pt")

if MODE.startswith("phalanx"):
    import phalanx as px
    from phalanx import elastic as el
    from phalanx.elastic import inprocess

    if A.get("trace"):   # --trace: a "phase" row (start, end) for each step of a re-form, to split its pause
        import functools
        import importlib

        import phalanx.runtime
        from phalanx.elastic import staging
        elrun, elstate = (importlib.import_module(f"phalanx.elastic.{m}") for m in ("run", "state"))  # (run: a function too)

        def traced(owner, name):
            inner = getattr(owner, name)

            @functools.wraps(inner)
            def wrapper(*args, **kwargs):
                t = time.time()
                try:
                    return inner(*args, **kwargs)
                finally:
                    if inprocess.active() and (name not in ("commit", "broadcast_coalesced") or time.time() - t > 0.005):
                        log("phase", name=name, t0=t)
            setattr(owner, name, wrapper)
        import torch.distributed as dist_

        from phalanx.elastic import handover, lost
        gradients = importlib.import_module("phalanx.parallel.data.gradients")
        rt_init = sys.modules["phalanx.runtime"]
        for owner, names in ((lost, ["shut", "group_sockets"]), (dist_, ["destroy_process_group", "init_process_group"]),
                             (rt_init, ["gather_hosts", "load", "shutdown", "detect_environment"]),
                             (gradients, ["agree_learned"]), (handover, ["share", "receive"]),
                             (inprocess, ["reform", "_leave_group", "_join_group"]), (staging, ["make_group", "adopt"]),
                             (phalanx.runtime, ["init"]), (elrun, ["_rederive_strategies", "_roll_back"]),
                             (el.TorchState, ["sync", "restore", "commit"]),
                             (elstate, ["allgather_object", "broadcast_object", "broadcast_coalesced"])):
            for name in names:
                traced(owner, name)

    if A.get("vote_s") is not None:   # --vote-s: the members' quiet vote spacing (a diagnostic)
        from phalanx.elastic import pending
        pending.VOTE_S = A["vote_s"]
    px.init()
    net = make()
    opt = optimizer(net)
    model = px.DataParallel(net)
    state = el.TorchState(net, opt, step=0, commit_dir=OUT + "/commits", snapshot_every=A["snapshot_every"],
                          recover=A["recover"], **({"snapshot_period_s": A["snapshot_period"]}
                                                   if A.get("snapshot_period") is not None and A["recover"] == "live" else {}))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    boot()
    log("start", rank=px.rank(), size=px.size(), phalanx=px.__file__)

    if MODE == "phalanx-ab":   # windows of the same job: no commit / live commits / copying commits
        copying = el.TorchState(net, opt, step=0, commit_dir=OUT + "/commits-copy",
                                snapshot_every=A["snapshot_every"], recover="commit")
        modes = {"none": None, "live": state, **({"copy": copying} if A.get("ab_copy", True) else {})}
        if A.get("ab_control"):   # a fourth window that commits nothing either: the A/B read on no difference
            modes["none2"] = None
        import torch.distributed as dist_
        votes, all_reduce = [0], dist_.all_reduce

        def counted(tensor, *args, **kwargs):   # the commits' votes: the one int64 allreduce of the job
            votes[0] += tensor.dtype == torch.int64
            return all_reduce(tensor, *args, **kwargs)
        dist_.all_reduce = counted

    @el.run
    def train(state):
        if MODE == "phalanx-ab":
            names = list(modes)
            for w in range(A["ab_rounds"] * len(names)):
                name = names[(w + w // len(names)) % len(names)]   # the order rotates every round
                t, in_commit, voted = time.perf_counter(), 0.0, votes[0]
                for _ in range(A["ab_window"]):
                    x, y = batch(state.step, px.rank(), px.size())
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    state.step += 1
                    if modes[name] is not None:
                        c = time.perf_counter()
                        modes[name].step = state.step
                        modes[name].commit()
                        in_commit += time.perf_counter() - c
                if w >= len(names):   # the first round warms up; rank 0's windows are the A/B's
                    log("window" if px.rank() == 0 else "rank_window", mode=name, round=w // len(names),
                        s=time.perf_counter() - t, commit_s=in_commit, votes=votes[0] - voted, rank=px.rank())
            return
        while state.step < stop_at():
            check_raise(state.step)
            x, y = batch(state.step, px.rank(), px.size())
            opt.zero_grad()
            t_step = time.time()
            nn.functional.cross_entropy(model(x), y).backward()
            t_back = time.time()
            opt.step()
            state.step += 1
            log("step", step=state.step, rank=px.rank(), size=px.size(), key=[restart, inprocess.generation()],
                **({"t_step": t_step, "t_back": t_back} if A.get("trace") else {}))
            if A["commit_every"] and state.step % A["commit_every"] == 0:
                state.commit()

    train(state)
    if px.rank() == 0:
        save(net.parameters())
        log("end", step=state.step)

elif MODE.startswith("torchft"):
    from torchft import DistributedDataParallel, Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    replica = int(os.environ["FT_REPLICA"])
    net = make()
    inner = optimizer(net)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=A["timeout"])),
        min_replica_size=1,
        load_state_dict=lambda sd: (net.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": inner.state_dict()},
        replica_id=f"replica{replica}",
        timeout=timedelta(seconds=A["timeout"]),
        quorum_timeout=timedelta(seconds=A["timeout"] + 30),
        use_async_quorum=False,
    )
    if A["ft_ddp"]:   # torchft's DistributedDataParallel (its README's train_ddp.py)
        model = DistributedDataParallel(manager, net)
    else:             # the manager's own allreduce of one flat gradient (errors end in should_commit)
        model = net

        def average():
            grads = [p.grad for p in net.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(v)
    opt = OptimizerWrapper(manager, inner)
    boot()
    log("start", rank=replica, size=None)
    while manager.current_step() < stop_at():
        step = manager.current_step()
        check_raise(step)
        opt.zero_grad()  # the quorum (and, for a newcomer or a laggard, the recovery from a peer)
        step = manager.current_step()
        r, n = manager.participating_rank(), manager.num_participants()
        x, y = batch(step, r if r is not None else 0, max(n, 1))
        nn.functional.cross_entropy(model(x), y).backward()
        if not A["ft_ddp"]:
            average()
        opt.step()  # should_commit: applied only if every participant's step succeeded
        if manager.current_step() > step and r is not None:
            log("step", step=manager.current_step(), rank=r, size=n, key=[getattr(manager, "_quorum_id", n)])
    if manager.participating_rank() in (0, None):
        save(net.parameters())
        log("end", step=manager.current_step())
    manager.shutdown(wait=False)

else:  # torchrun (+ DCP) and plain ddp
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=A["timeout"]))
    rank, size = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = DDP(make())
    opt = optimizer(model)
    step, ckpt = 0, OUT + "/dcp"
    done = sorted((int(d) for d in os.listdir(ckpt) if os.path.exists(f"{ckpt}/{d}/done")) if os.path.isdir(ckpt) else [])
    if MODE == "torchrun" and done:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=f"{ckpt}/{done[-1]}")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step = done[-1]
    log("start", rank=rank, size=size, step=step)
    while step < stop_at():
        check_raise(step)
        x, y = batch(step, rank, size)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        log("step", step=step, rank=rank, size=size, key=[restart])
        if MODE == "torchrun" and step % A["ckpt_every"] == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/{step}")
            dist.barrier()
            if rank == 0:
                open(f"{ckpt}/{step}/done", "w").close()
    if rank == 0:
        save(model.module.parameters())
        log("end", step=step)
    dist.destroy_process_group()
