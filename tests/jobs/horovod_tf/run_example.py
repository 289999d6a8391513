"""Run Horovod's TensorFlow 2 examples with a local MNIST stand-in (no download).

``python run_example.py [--fit-cap EPOCHS,STEPS] EXAMPLE.py [ARGS...] [-- [--fit-cap E,S] NEXT.py ...]``:
each script in turn, in this process (the test runs several in one job to pay TensorFlow's start
once). ``mnist.load_data`` (tf-keras's and Keras 3's) returns a small learnable stand-in: 28x28
uint8 images, each of the 10 classes a fixed random template plus noise. ``--fit-cap`` (a test's
budget) makes every ``Model.fit`` of that script run at most that many epochs of at most that many
steps; nothing else in the example changes. Everything else (the script, its arguments) is its own.
"""

import os
import runpy
import sys
import time

import numpy as np


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
        if argv[0] == "--fit-cap":
            epochs_cap, steps_cap = (int(x) for x in argv[1].split(","))
            keras_module.Model.fit = _capped(fit, epochs_cap, steps_cap)
            argv = argv[2:]
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python EXAMPLE.py` has it
        print(f"RUN {os.path.basename(argv[0])}", flush=True)
        start = time.monotonic()
        runpy.run_path(argv[0], run_name="__main__")
        print(f"DONE {os.path.basename(argv[0])} in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
