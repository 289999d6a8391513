"""phalanx.ray on a local Ray cluster: horovod.ray's documented examples with only the import
changed, bitwise-equal training against ``phalanx.run`` and ``phalanx run -np 2``, callbacks,
rank-prefixed output, a failing rank that stops the whole job, and an elastic job that survives
a killed actor in-process and admits its replacement. On the same cluster (one start for both):
phalanx.tune's Ray Tune trials, RayExecutor jobs that ASHA stops early."""

import os
import resource
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"^\[\d+\]: ")  # before ray: keep every rank's lines
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")

from ray_local import start_local_ray  # noqa: E402

import phalanx as px  # noqa: E402
import phalanx.horovod as hvd  # noqa: E402 - horovod.ray's examples use `import horovod.torch as hvd`
from phalanx.horovod.ray import RayExecutor  # noqa: E402 - was: from horovod.ray import RayExecutor
from phalanx.ray import ray_logger  # noqa: E402

# Functions of this module go to the actors by value (the actors cannot import a test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 6
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]  # a local cluster and several jobs: minutes when the machine is loaded


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(ray)
    yield
    ray.shutdown()


def _live_actor_names(prefix: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


# -- the job compared across launchers -----------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_data_parallel():
    """DataParallel training; every launcher runs exactly this."""
    px.init()
    model = px.DataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, px.rank())
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ray_logger.log({"step": step, "rank": px.rank()})
    return _flat(model.module if hasattr(model, "module") else model)


def train_distributed_optimizer():
    """The same job through hvd.DistributedOptimizer, for the phalanx.run reference."""
    trainer = MyModel(0.1)
    for _ in range(STEPS):
        trainer.train()
    return trainer.flat()


class MyModel:
    """horovod.ray's stateful example (docs/ray.rst), with a concrete model and train step."""

    def __init__(self, learning_rate):
        hvd.init()
        self.model = _model()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=learning_rate)
        self.optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.step = 0

    def get_weights(self):
        return dict(self.model.named_parameters())

    def train(self):
        x, y = _batch(self.step, hvd.rank())
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def flat(self):
        return _flat(self.model)


def reference_jobs():
    """Both jobs under phalanx.run, in one spawned group."""
    return train_data_parallel(), train_distributed_optimizer()


@pytest.fixture(scope="module")
def reference(local_ray):
    return px.run(reference_jobs, np=2)[0]


def _rank_niceness() -> tuple[int, int]:
    """(this thread's niceness, the highest niceness of gloo's threads) in a rank."""
    highest = None
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if "gloo" not in f.read():
                continue
        with open(f"/proc/self/task/{tid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        highest = nice if highest is None else max(highest, nice)
    return os.getpriority(os.PRIO_PROCESS, 0), highest


# -- horovod.ray's documented examples -----------------------------------------------------------------

def test_stateless_run_example_then_data_parallel_bitwise_equal(local_ray, capfd, reference, tmp_path):
    num_workers = 2
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_hosts=1, num_workers_per_host=num_workers, use_gpu=False)
    executor.start()

    def simple_fn():
        hvd.init()
        print("hvd rank", hvd.rank(), flush=True)
        return hvd.rank(), hvd.local_rank(), hvd.size(), hvd.cross_size()

    result = executor.run(simple_fn)
    assert len({r for r, *_ in result}) == num_workers
    assert result == [(0, 0, 2, 1), (1, 1, 2, 1)]
    # Ray starts workers at nice 15; a rank's work (its thread and gloo's) runs at the driver's, as under
    # `phalanx run`, wherever this user may lower a niceness (else the driver warned how to start Ray)
    driver_nice = os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - driver_nice:
        assert executor.run(_rank_niceness) == [(driver_nice, driver_nice)] * num_workers, "ranks run niced"

    # the same actors run a second function: DataParallel training, rank 0's logs to the callback
    logged = []
    on_ray = executor.run(train_data_parallel, callbacks=[logged.append])
    seen = ""
    for _ in range(120):  # Ray forwards worker output to the driver asynchronously
        seen += capfd.readouterr().out
        if "[0]: hvd rank 0" in seen and "[1]: hvd rank 1" in seen:
            break
        time.sleep(0.25)
    executor.shutdown()
    assert "[0]: hvd rank 0" in seen and "[1]: hvd rank 1" in seen, f"no rank-prefixed output: {seen[-2000:]}"
    assert logged == [{"step": s, "rank": 0} for s in range(STEPS)], "callbacks get rank 0's logs, in order"
    assert torch.equal(on_ray[0], on_ray[1]), "replicas differ on Ray"
    assert torch.equal(on_ray[0], reference[0]), "Ray and phalanx.run trained different weights"

    out = tmp_path / "rank0.pt"
    script = tmp_path / "job.py"
    script.write_text("import torch\nimport test_ray\nimport phalanx as px\n"
                      "flat = test_ray.train_data_parallel()\n"
                      f"if px.rank() == 0: torch.save(flat, {str(out)!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs"),
                                            os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, str(script)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(on_ray[0], torch.load(out)), "Ray and `phalanx run -np 2` trained different weights"


def test_stateful_execute_example_bitwise_equal(local_ray, reference):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start(executable_cls=MyModel, executable_args=[0.1])
    for _ in range(STEPS):
        executor.execute(lambda worker: worker.train())
    result = executor.execute(lambda worker: worker.get_weights())
    assert all(isinstance(res, dict) for res in result)
    flats = executor.execute(lambda worker: worker.flat())
    chief = executor.execute_single(lambda worker: worker.flat())
    # every line the ranks print reaches the driver before execute() returns (a script may exit at once)
    from phalanx.ray.output import Arrivals

    with Arrivals() as arrivals:
        assert arrivals.forwarding, "the driver should be forwarding the actors' output (log_to_driver)"
        pids = executor.execute(lambda worker: (print("\n".join(f"line {i}" for i in range(40))), os.getpid())[1])
        got = {pid: arrivals.lines_from(pid) for pid in pids}
    executor.shutdown()
    assert got == {pid: 40 for pid in pids}, f"lines each rank printed that had reached the driver: {got}"
    assert torch.equal(flats[0], flats[1]), "replicas differ on Ray"
    assert torch.equal(chief, flats[0])
    assert torch.equal(flats[0], reference[1]), "Ray and phalanx.run trained different weights"


# -- failures ---------------------------------------------------------------------------------------------

def failing_job():
    px.init()
    if px.rank() == 1:
        raise ValueError("boom at rank 1")
    px.barrier()  # rank 0 waits for a peer that never comes: the driver must stop it
    return "unreachable"


def test_worker_exception_names_rank_and_leaves_no_actor(local_ray):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, placement_strategy="SPREAD")
    executor.start()
    names = list(executor.worker_names)
    assert len(_live_actor_names("phalanx-")) >= 2
    with pytest.raises(px.RankError) as info:
        executor.run(failing_job, kwargs={})
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed" in str(err) and "boom at rank 1" in str(err) and "failing_job" in str(err)
    assert isinstance(err.exception, ValueError)
    for _ in range(40):
        if not set(names) & set(_live_actor_names("phalanx-")):
            break
        time.sleep(0.25)
    assert not set(names) & set(_live_actor_names("phalanx-")), "actors left behind"
    with pytest.raises(RuntimeError, match="call start"):
        executor.run(failing_job)


# -- elastic --------------------------------------------------------------------------------------------

def train_elastic(steps):
    """phalanx.elastic State with DataParallel. After step 3 of generation 0 every rank waits (bounded) for the
    next generation (the test kills rank 1 there, so the kill always lands mid-run); below 2 workers, rank 0
    waits (bounded) at a commit for the driver to admit a replacement, so the job grows back before it ends."""
    from phalanx import elastic
    from phalanx.elastic import inprocess

    px.init()
    model = px.DataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model, opt, step=0)

    @elastic.run
    def loop(state):
        while state.step < steps:
            x, y = _batch(state.step, px.rank())
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            deadline = time.monotonic() + 120
            while px.size() < 2 and inprocess.latest_generation() <= inprocess.generation():
                if time.monotonic() > deadline:
                    raise TimeoutError("the driver admitted no replacement within 120 s")
                time.sleep(0.02)
            state.commit()
            ray_logger.log({"step": state.step, "size": px.size()})
            if state.step == 3 and inprocess.generation() == 0:  # the driver's callback kills rank 1 now:
                while inprocess.latest_generation() == 0:  # every rank waits for the survivors' generation
                    if time.monotonic() > deadline:
                        raise TimeoutError("rank 1 was not killed within 120 s")
                    time.sleep(0.02)

    loop(state)
    return _flat(model.module if hasattr(model, "module") else model), os.environ["PHALANX_ELASTIC_WID"]


def test_elastic_killed_actor_survived_in_process_and_replaced(local_ray):
    from phalanx.horovod.ray import ElasticRayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1, max_workers=2, num_workers=2)
    executor.start(extra_env_vars={"PHALANX_TIMEOUT": "60"})
    logged, killed = [], []

    def kill_rank_1(info):
        logged.append(info)
        if info["step"] == 3 and not killed:  # mid-run: w1 (rank 1 of generation 0) is killed
            killed.append(executor.worker_names[1])
            ray.kill(ray.get_actor(executor.worker_names[1]))

    results = executor.run(train_elastic, args=[8], callbacks=[kill_rank_1])
    sizes = [size for _, size in executor.world_sizes]
    assert killed and sizes == [2, 1, 2], f"world sizes {executor.world_sizes}, logged {logged}"
    assert [wid for _, wid in results] == ["w0", "w2"], "the survivor and the replacement finish, in rank order"
    assert torch.equal(results[0][0], results[1][0]), "replicas differ after the re-form and the admission"
    assert logged[-1] == {"step": 8, "size": 2}
    names = list(executor.worker_names)
    assert len(names) == 3 and not set(names) & set(_live_actor_names("phalanx-")), "actors left behind"
    with pytest.raises(RuntimeError, match="run\\(fn\\) only"):
        executor.execute(lambda worker: None)
    executor.shutdown()
    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=2, elastic_timeout=30)
    horovod_style = ElasticRayExecutor(settings, cpus_per_slot=1)
    assert (horovod_style.min_workers, horovod_style.max_workers, horovod_style.elastic_timeout) == (1, 2, 30)



def test_elastic_on_ray_warns_once_when_an_actor_stays_niced(local_ray, monkeypatch):
    # As root every actor comes to the driver's niceness, so the warning is driven here with an actor's
    # setup answer of 15 (what a non-root driver gets from Ray's worker_niceness); RayExecutor shares it
    from phalanx.ray import elastic_job as ray_elastic
    from phalanx.ray import worker as ray_worker

    monkeypatch.setattr(ray_worker, "_nice_warned", False)
    warned = []
    monkeypatch.setattr(ray_worker.log, "warning", lambda msg, *args: warned.append(msg % args))
    job = ray_elastic.ElasticJob(None, len, [], {}, None)
    job._nice = 0
    job._niceness = [ray.put(15), ray.put(15)]
    job._check_niceness()
    job._niceness = [ray.put(15)]
    job._check_niceness()
    assert len(warned) == 1 and "the ranks run at nice 15, the driver at 0" in warned[0], warned
    assert "RAY_worker_niceness=0" in warned[0] and job._niceness == [], warned

def test_elastic_worker_records_its_exit_status_and_prefixes_its_rank():
    # Ray reports only that an actor died; a worker leaving by os._exit (shrunk out, the job done while it
    # waited to join, a failed re-form) first writes its status to the job's store for the driver
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = ("import os\nfrom phalanx.ray.worker import BaseWorker\n"
            f"BaseWorker().setup({{'PHALANX_ELASTIC_STORE': '127.0.0.1:{store.port}', 'PHALANX_ELASTIC_WID': 'w9', "
            "'PHALANX_ELASTIC_JOIN': '1'}, None, -1, 1)\n"
            "print('waiting to join', flush=True)\nos.environ.pop('PHALANX_ELASTIC_JOIN')\n"
            "os.environ['RANK'] = '2'\nprint('admitted', flush=True)\nos._exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert store.check(["pxe/exit/w9"]) and store.get("pxe/exit/w9") == b"3", "no exit status on the store"
    assert proc.stdout.splitlines() == ["[w9]: waiting to join", "[2]: admitted"], proc.stdout


def test_rank_environments_host_major_with_gpus():
    from phalanx.ray.placement import rank_environments, ranks_host_major

    created = [{"node_id": "B", "hostname": "b", "gpu_ids": ["3"]}, {"node_id": "A", "hostname": "a", "gpu_ids": ["0"]},
               {"node_id": "B", "hostname": "b", "gpu_ids": ["1"]}, {"node_id": "A", "hostname": "a", "gpu_ids": ["2"]}]
    order = ranks_host_major(created)
    assert order == [0, 2, 1, 3]  # the first actor's host first, its actors in creation order
    envs = rank_environments([created[i] for i in order], master_addr="10.0.0.2", master_port=1234, use_gpu=True,
                             iface="eth1", nics={"eth1", "ib0"}, extra={"PHALANX_TIMEOUT": "60"})
    want = [("0", "0", "0", "3,1", "cuda:0"), ("1", "1", "0", "3,1", "cuda:1"),
            ("2", "0", "1", "0,2", "cuda:0"), ("3", "1", "1", "0,2", "cuda:1")]
    got = [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["CUDA_VISIBLE_DEVICES"], e["PHALANX_DEVICE"]) for e in envs]
    assert got == want
    e = envs[3]
    assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
    assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["PHALANX_LAUNCHER"]) == ("10.0.0.2", "1234", "ray")
    assert (e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"], e["PHALANX_TIMEOUT"]) == ("eth1", "eth1,ib0", "60")
    from phalanx.runtime import detect_environment

    info = detect_environment(envs[2])  # what px.init() will read in that actor
    assert (info.rank, info.size, info.local_rank, info.cross_rank, info.cross_size, info.master_port) == \
        (2, 4, 0, 1, 2, 1234)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 2, "num_hosts": 1}, "not both"),
    ({}, "give num_workers"),
    ({"num_workers": 0}, "positive integer"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "use_gpu=True"),
    ({"num_workers": 2, "placement_strategy": "RANDOM"}, "placement_strategy"),
    ({"min_workers": 3, "max_workers": 2}, "min_workers=3 is larger than max_workers=2"),
    ({"min_workers": 2, "max_workers": 3, "num_workers": 1}, "num_workers=1 .* must lie between"),
    ({"min_workers": 1, "num_hosts": 1}, "drop num_hosts"),
    ({"max_workers": 0}, "max_workers must be a positive integer"),
    ({"min_workers": 1, "elastic_timeout": 0}, "elastic_timeout must be positive"),
])
def test_bad_arguments_say_what_to_fix(kwargs, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        RayExecutor(RayExecutor.create_settings(timeout_s=10), **kwargs)


# -- issue 39: Horovod's elastic Ray examples, use_gpu on an elastic job, horovod.*.elastic import paths -----------

JOBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "horovod_torch")


def test_horovods_elastic_import_paths():
    from phalanx.horovod.torch.elastic import TorchState, run
    from phalanx.horovod.torch.elastic.sampler import ElasticSampler
    from phalanx.horovod.torch.elastic.state import ObjectState

    from phalanx.horovod.ray import ray_logger as hvd_ray_logger
    from phalanx.horovod.ray.elastic import ElasticRayExecutor, RayHostDiscovery, TestDiscovery

    assert ElasticSampler is hvd.elastic.ElasticSampler and TorchState is hvd.elastic.TorchState
    assert run is hvd.elastic.run and ObjectState is hvd.elastic.ObjectState and hvd_ray_logger is ray_logger
    assert ElasticRayExecutor is __import__("phalanx.ray", fromlist=["x"]).ElasticRayExecutor
    assert issubclass(TestDiscovery, RayHostDiscovery)


def test_elastic_visible_devices_put_rays_gpu_at_the_local_rank():
    from phalanx.ray.worker import elastic_visible_devices

    assert elastic_visible_devices(["2"], 4, 1) == ("0,2,1,3", 1)  # set_device(local_rank=1) -> Ray's GPU 2
    assert elastic_visible_devices(["0"], 2, 1) == ("1,0", 1)
    assert elastic_visible_devices(["3"], 4, 0) == ("3,0,1,2", 0)
    assert elastic_visible_devices(["1", "2"], 4, 5) == ("0,3,1,2", 2)  # more local ranks than GPUs: after the others
    with pytest.raises(ValueError, match="Ray gave this actor no GPU"):
        elastic_visible_devices([], 2, 0)


def test_test_discovery_sets_a_host_aside_and_brings_it_back(monkeypatch):
    from phalanx.horovod.ray import elastic as discovery

    nodes = [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": {"CPU": 4.0, "GPU": 1.0}}
             for i in range(3)] + [{"Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 8.0}}]
    monkeypatch.setattr(discovery.ray, "nodes", lambda: nodes)
    assert discovery.RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == \
        {"10.0.0.0": 2, "10.0.0.1": 2, "10.0.0.2": 2}
    assert sum(discovery.RayHostDiscovery(use_gpu=True).find_available_hosts_and_slots().values()) == 3
    now = [0.0]
    monkeypatch.setattr(discovery.time, "monotonic", lambda: now[0])
    test = discovery.TestDiscovery(min_hosts=2, max_hosts=3, change_frequency_s=10, verbose=False)
    sizes = []
    for step in range(4):  # 3 hosts = max_hosts: one set aside; then 2 = min_hosts: it comes back; ...
        now[0] = 10.0 * step
        sizes.append(len(test.find_available_hosts_and_slots()))
    assert sizes == [3, 2, 3, 2], sizes
    with pytest.raises(ValueError, match="graceful"):
        discovery.TestDiscovery(1, 2, 5, _graceful=False)


def test_elastic_use_gpu_without_gpus_in_the_cluster_says_so(local_ray):
    from phalanx.horovod.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=2)
    settings.placement_group_timeout_s = 1
    executor = ElasticRayExecutor(settings, use_gpu=True, cpus_per_slot=1)
    assert executor.spec.worker_resources() == {"CPU": 1.0, "GPU": 1.0}
    with pytest.raises(TimeoutError, match="no room for min_workers=1 .*use_gpu needs GPUs in the cluster"):
        executor.start()
    settings.discovery = object()
    with pytest.raises(ValueError, match="has no find_available_hosts_and_slots"):
        ElasticRayExecutor(settings, override_discovery=False)


# -- phalanx.tune: Ray Tune trials that are RayExecutor jobs, on this module's cluster ---------------------

def tune_train_fn(config):
    """Every rank; the metric is `score` * epoch, so lower-score trials fall behind at each rung."""
    from phalanx.tune import report

    px.init()
    for epoch in range(1, 5):
        value = px.allreduce(torch.tensor([config["score"] * epoch]), op=px.Average).item()
        report(score=value, epoch=epoch)


def test_ray_tune_asha_stops_trials_early(local_ray, tmp_path):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from phalanx.tune import distributed_trainable

    # each trial takes both CPUs of the cluster: the jobs before this one must have given theirs back
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= 2, (ray.available_resources(), _live_actor_names(""))
    tuner = tune.Tuner(
        distributed_trainable(tune_train_fn, num_workers=2, cpus_per_worker=1),
        param_space={"score": tune.grid_search([1.0, 0.25])},  # one at a time: 1.0 first, 0.25 falls behind
        tune_config=tune.TuneConfig(scheduler=ASHAScheduler(metric="score", mode="max", max_t=4,
                                                            grace_period=1, reduction_factor=2,
                                                            time_attr="training_iteration")),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="asha", verbose=0))
    results = tuner.fit()
    assert not results.errors, results.errors
    epochs = {r.config["score"]: r.metrics["epoch"] for r in results}
    assert epochs[1.0] == 4, epochs  # the best trial runs to the end
    assert epochs[0.25] < 4, f"ASHA did not stop the worse trial: {epochs}"
    histories = {r.config["score"]: list(r.metrics_dataframe["score"]) for r in results}
    assert histories[1.0] == [1.0, 2.0, 3.0, 4.0], "every epoch of rank 0 reached Tune"


def test_horovods_pytorch_ray_elastic_example_with_only_the_import_changed(tmp_path):
    """Horovod's examples/ray/pytorch_ray_elastic.py: ElasticRayExecutor(settings, use_gpu=True, cpus_per_slot=2)
    on a local cluster of 4 CPUs and 2 (Ray's logical) GPUs: two workers, one GPU reserved for each; the
    CPU build of torch trains on the CPU. A tiny local MNIST, one epoch of one step per worker."""
    import importlib.util

    sys.path.insert(0, JOBS)
    try:
        from mnist_data import write_mnist
    finally:
        sys.path.remove(JOBS)
    data = write_mnist(str(tmp_path / "data"), n_train=64, n_test=32)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(JOBS)))
    path = [repo, os.environ.get("PYTHONPATH", "")]
    if importlib.util.find_spec("torchvision") is None:
        path.insert(0, os.path.join(JOBS, "standin"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore",
           "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(JOBS, "run_ray_example.py"),
                           os.path.join(JOBS, "pytorch_ray_elastic.py"), "--epochs", "1", "--batch-size", "32",
                           "--test-batch-size", "32", "--data-dir", data],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "elastic job of 2 workers" in out, out[-5000:]
    for rank in (0, 1):
        assert f"[{rank}]: Train Epoch: 1 [0/32 (0%)]" in out, out[-5000:]
    assert "[0]: Test set: Average loss:" in out, out[-5000:]
