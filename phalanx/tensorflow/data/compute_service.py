"""Horovod's ``horovod.tensorflow.data.compute_service``: tf.data service workers in a job of their own.

A *compute* job (``phalanx run -np 2 python -m phalanx.tensorflow.data.compute_worker CONFIG``)
starts ``tf.data`` service dispatchers and workers and writes a config file; the *training* job
reads it and sends its input pipeline to the service::

    compute job   rank 0: ComputeService (a TCPStore)  ─ writes CONFIG (addresses, key)
                  every rank: WorkerServer, registered with its dispatcher
    training job  TfDataServiceConfig.read(CONFIG) ─ dataset.send_to_data_service(config, rank, size)
                  ─ model.fit(...) ─ rank 0: config.compute_client().shutdown() ends the compute job

The service the two jobs meet at is a ``torch.distributed.TCPStore`` on the compute job's rank 0
(Horovod's is its own HTTP service): dispatchers register their address, workers count themselves
in, and a ``shutdown`` key ends the compute job. ``key`` namespaces the store's keys; it is not
authentication (anyone who can reach the port can talk to the store, as to phalanx's own store).

Example (Horovod's tensorflow2_mnist_data_service.py, only the imports changed)::

    from phalanx.tensorflow.data.compute_service import TfDataServiceConfig
    config = TfDataServiceConfig.read("compute.json", wait_for_file_creation=True)
    dataset = dataset.batch(128).send_to_data_service(config, hvd.rank(), hvd.size())
"""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf
import torch.distributed as dist

__all__ = ["TfDataServiceConfig", "ComputeService", "ComputeClient", "tf_data_service", "send_to_data_service",
           "compute_worker_fn", "make_secret_key"]

_FOREVER = datetime.timedelta(days=7)


def make_secret_key() -> bytes:
    """A random 32-byte key (Horovod's ``secret.make_secret_key``)."""
    return secrets.token_bytes(32)


class ComputeClient:
    """Talks to a :class:`ComputeService` at ``addresses`` (``{interface: [(host, port), ...]}``)."""

    def __init__(self, addresses: Mapping[str, Sequence[tuple[str, int]]], key: bytes, verbose: int = 1):
        host, port = next(iter(addresses.values()))[0]
        self._store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
        self._prefix = binascii.hexlify(key[:8]).decode() + "/"
        self.verbose = verbose

    def _wait(self, name: str, timeout: float) -> str:
        key = self._prefix + name
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout))
        except RuntimeError as err:
            raise TimeoutError(f"tf.data compute service: no {name!r} within {timeout} s ({err})") from None
        return self._store.get(key).decode()

    def register_dispatcher(self, dispatcher_id: int, dispatcher_address: str) -> None:
        self._store.set(f"{self._prefix}dispatcher/{dispatcher_id}", dispatcher_address)

    def wait_for_dispatcher_registration(self, dispatcher_id: int, timeout: float) -> str:
        return self._wait(f"dispatcher/{dispatcher_id}", timeout)

    def register_worker_for_dispatcher(self, dispatcher_id: int, worker_id: int) -> None:
        self._store.add(f"{self._prefix}workers/{dispatcher_id}", 1)

    def wait_for_dispatcher_worker_registration(self, dispatcher_id: int, timeout: float) -> None:
        want = int(self._wait("workers_per_dispatcher", timeout))
        deadline = time.monotonic() + timeout
        while self._store.add(f"{self._prefix}workers/{dispatcher_id}", 0) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"tf.data compute service: dispatcher {dispatcher_id} has fewer than {want} "
                                   f"workers after {timeout} s")
            time.sleep(0.1)

    def shutdown(self) -> None:
        self._store.set(self._prefix + "shutdown", "1")

    def wait_for_shutdown(self) -> None:
        self._wait("shutdown", _FOREVER.total_seconds())


class ComputeService:
    """The meeting point of a compute job and its training jobs: a TCPStore on this host, free port."""

    def __init__(self, dispatchers: int, workers_per_dispatcher: int, key: bytes):
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60))
        self._host = socket.gethostname()
        prefix = binascii.hexlify(key[:8]).decode() + "/"
        self._store.set(prefix + "workers_per_dispatcher", str(int(workers_per_dispatcher)))
        self.dispatchers = dispatchers

    def addresses(self) -> dict[str, list[tuple[str, int]]]:
        return {"host": [(self._host, int(self._store.port))]}

    def shutdown(self) -> None:
        self._store = None


@dataclasses.dataclass(frozen=True)
class TfDataServiceConfig:
    """Where the compute job's service is and how it is laid out (Horovod's, field for field)."""

    dispatchers: int
    workers_per_dispatcher: int
    dispatcher_side: str
    addresses: Mapping[str, Sequence[tuple[str, int]]]
    key: bytes
    timeout: int = 60

    def compute_client(self, verbose=1) -> ComputeClient:
        return ComputeClient(self.addresses, self.key, verbose=verbose)

    def to_dict(self) -> dict[str, Any]:
        config = dataclasses.asdict(self)
        config["key"] = binascii.hexlify(self.key).decode()
        return config

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> TfDataServiceConfig:
        config = dict(config)
        config["key"] = binascii.unhexlify(config["key"])
        config["addresses"] = {intf: [(a[0], int(a[1])) for a in addrs] for intf, addrs in config["addresses"].items()}
        return TfDataServiceConfig(**config)

    def write(self, filename: str) -> None:
        """Write the config to ``filename`` atomically (a reader never sees half of it)."""
        folder = os.path.dirname(os.path.abspath(filename))
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=os.path.basename(filename), delete=False) as out:
            out.write(json.dumps(self.to_dict()))
        os.replace(out.name, filename)

    @staticmethod
    def read(filename: str, wait_for_file_creation: bool = False) -> TfDataServiceConfig:
        while wait_for_file_creation and not os.path.exists(filename):
            time.sleep(1)
        with open(filename) as f:
            return TfDataServiceConfig.from_dict(json.load(f))


@contextlib.contextmanager
def tf_data_service(compute_config: TfDataServiceConfig, rank: int):
    """The address of this rank's tf.data dispatcher; with ``dispatcher_side='training'`` this job starts it."""
    compute = compute_config.compute_client(verbose=2)
    server = None
    if compute_config.dispatcher_side == "training" and (compute_config.dispatchers > 1 or rank == 0):
        server = tf.data.experimental.service.DispatchServer()
        compute.register_dispatcher(rank, server.target)
        logging.info("registered tf.data dispatcher %d at %s", rank, server.target)
    dispatcher_id = rank if compute_config.dispatchers > 1 else 0
    address = compute.wait_for_dispatcher_registration(dispatcher_id, compute_config.timeout)
    compute.wait_for_dispatcher_worker_registration(dispatcher_id, compute_config.timeout)
    try:
        yield address
    finally:
        if server is not None:
            server._stop()  # TensorFlow has no public way to stop a dispatcher
            server.join()


def send_to_data_service(dataset, compute_config: TfDataServiceConfig, rank: int, size: int | None = None,
                         processing_mode: str = "distributed_epoch", reuse_dataset: bool = False,
                         round_robin: bool = False):
    """``dataset`` processed by the compute job's tf.data service (also ``Dataset.send_to_data_service``)."""
    if compute_config.dispatcher_side == "training":
        raise RuntimeError("send_to_data_service: a training-side dispatcher needs the tf_data_service context "
                           "manager (with tf_data_service(config, rank) as address: ...)")
    with tf_data_service(compute_config, rank) as address:
        return dataset.apply(tf.data.experimental.service.distribute(
            processing_mode=processing_mode, service=address, job_name="job" if reuse_dataset else None,
            consumer_index=rank if reuse_dataset and round_robin else None,
            num_consumers=size if reuse_dataset and round_robin else None))


tf.data.Dataset.send_to_data_service = send_to_data_service


def compute_worker_fn(compute_config: TfDataServiceConfig) -> None:
    """One compute rank: its dispatcher (compute side, first worker of each), its worker, until shutdown."""
    import phalanx.tensorflow as hvd

    hvd.init()
    index = hvd.rank()
    per = compute_config.workers_per_dispatcher
    dispatcher_index = index // per
    compute = compute_config.compute_client(verbose=2)
    dispatcher = None
    if compute_config.dispatcher_side == "compute" and index % per == 0:
        dispatcher = tf.data.experimental.service.DispatchServer()
        compute.register_dispatcher(dispatcher_index, dispatcher.target)
    address = compute.wait_for_dispatcher_registration(dispatcher_index, compute_config.timeout)
    worker = tf.data.experimental.service.WorkerServer(tf.data.experimental.service.WorkerConfig(
        dispatcher_address=address.split("://")[1], heartbeat_interval_ms=1000,
        dispatcher_timeout_ms=compute_config.timeout * 1000))
    worker.start()
    compute.register_worker_for_dispatcher(dispatcher_index, index)
    compute.wait_for_shutdown()
    # Every worker stops before any dispatcher. A worker's stop joins its tasks' prefetch threads, and a
    # distributed_epoch task's thread asks its dispatcher for the next split: with that dispatcher
    # already gone it retries until the dispatcher timeout, and the stop (which keeps the GIL, freezing
    # the process) waits with it (issue 39: seen in a native stack, ~FirstComeFirstServedTaskRunner
    # joining its thread while "Failed to get next split: UNAVAILABLE").
    worker._stop()  # TensorFlow has no public way to stop its servers
    worker.join()
    hvd.barrier()
    if dispatcher is not None:
        dispatcher._stop()
        dispatcher.join()
