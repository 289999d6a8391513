"""Run Horovod's TensorFlow 2 examples with a local MNIST stand-in (no download).

``python run_example.py [--fit-cap EPOCHS,STEPS] [--compute-service CONFIG] EXAMPLE.py [ARGS...] [-- NEXT.py ...]``:
each script in turn, in this process (the test runs several in one job to pay TensorFlow's start
once). ``mnist.load_data`` (tf-keras's and Keras 3's) returns a small learnable stand-in: 28x28
uint8 images, each of the 10 classes a fixed random template plus noise. ``--fit-cap`` (a test's
budget) makes every ``Model.fit`` of that script run at most that many epochs of at most that many
steps; nothing else in the example changes. Everything else (the script, its arguments) is its own.
``--compute-service CONFIG`` runs the tf.data compute job Horovod's data-service example needs in
this job's ranks instead of a second job (a thread each running ``compute_worker_fn``, as
``compute_worker`` would, rank 0 holding the service and writing CONFIG), and prints ``COMPUTE DONE``
once the example has shut it down. The example's rank 0 shuts the service down as soon as its own
training ends; here the other rank may still be training, so the shutdown takes effect once every
rank's example is done (a barrier). A stop that still runs ``STOP_S`` after that ends the rank
(faulthandler's watchdog, which needs no GIL: TensorFlow's server stop keeps it while it waits) with
every thread's stack and status 1, instead of hanging the job.
"""

import faulthandler
import os
import runpy
import sys
import threading
import time

import numpy as np

STOP_S = 60  # seconds the compute side may take to stop once shut down (it takes well under one)


def _mnist(path="mnist.npz"):
    rng = np.random.default_rng(1)
    templates = rng.integers(0, 256, (10, 28, 28))
    labels = rng.integers(0, 10, 2048)
    images = np.clip(templates[labels] * 0.7 + rng.integers(0, 77, (2048, 28, 28)), 0, 255).astype("uint8")
    return (images[:1536], labels[:1536].astype("uint8")), (images[1536:], labels[1536:].astype("uint8"))


def _capped(fit, epochs_cap, steps_cap):
    def capped(self, *args, **kwargs):
        kwargs["epochs"] = min(kwargs.get("epochs", 1), epochs_cap)
        if kwargs.get("steps_per_epoch") is not None:
            kwargs["steps_per_epoch"] = min(kwargs["steps_per_epoch"], steps_cap)
        return fit(self, *args, **kwargs)

    return capped


def _compute_side(config_path):
    """The compute job of Horovod's data-service example, in this rank: a thread running its worker."""
    import phalanx.tensorflow as hvd
    from phalanx.tensorflow.data.compute_service import (
        ComputeClient,
        ComputeService,
        TfDataServiceConfig,
        compute_worker_fn,
        make_secret_key,
    )

    hvd.init()
    service = None
    if hvd.rank() == 0:
        key = make_secret_key()
        service = ComputeService(1, hvd.size(), key=key)
        TfDataServiceConfig(dispatchers=1, workers_per_dispatcher=hvd.size(), dispatcher_side="compute",
                            addresses=service.addresses(), key=key, timeout=120).write(config_path)
    config = TfDataServiceConfig.read(config_path, wait_for_file_creation=True)

    def serve():
        compute_worker_fn(config)
        print("COMPUTE DONE", flush=True)

    thread = threading.Thread(target=serve, name="compute-worker", daemon=True)
    thread.start()
    asked = []
    real_shutdown = ComputeClient.shutdown
    ComputeClient.shutdown = lambda client: asked.append(client)  # deferred until every rank is done (finish)

    def finish():
        hvd.barrier()  # no rank's worker stops while another rank still trains
        ComputeClient.shutdown = real_shutdown
        # TensorFlow's worker stop keeps the GIL while it waits: a hung stop freezes every Python thread,
        # so the guard is faulthandler's C watchdog (prints every thread's stack, exits with status 1)
        print(f"COMPUTE STOPPING (a stop still running after {STOP_S} s ends the rank)", flush=True)
        faulthandler.dump_traceback_later(STOP_S, exit=True)
        for client in asked:
            client.shutdown()
        thread.join()
        faulthandler.cancel_dump_traceback_later()

    return finish, service


def main():
    import tensorflow as tf

    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        import tf_keras as keras_module
    else:
        import keras as keras_module
    keras_module.datasets.mnist.load_data = _mnist
    tf.keras.datasets.mnist.load_data = _mnist
    fit = keras_module.Model.fit
    scripts = [[]]
    for word in sys.argv[1:]:
        if word == "--":
            scripts.append([])
        else:
            scripts[-1].append(word)
    for argv in scripts:
        keras_module.Model.fit = fit
        compute = None
        if argv[0] == "--fit-cap":
            epochs_cap, steps_cap = (int(x) for x in argv[1].split(","))
            keras_module.Model.fit = _capped(fit, epochs_cap, steps_cap)
            argv = argv[2:]
        if argv[0] == "--compute-service":
            compute = _compute_side(argv[1])
            argv = argv[2:]
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python EXAMPLE.py` has it
        print(f"RUN {os.path.basename(argv[0])}", flush=True)
        start = time.monotonic()
        runpy.run_path(argv[0], run_name="__main__")
        if compute is not None:
            compute[0]()
        print(f"DONE {os.path.basename(argv[0])} in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
