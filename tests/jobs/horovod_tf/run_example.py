"""Run one of Horovod's TensorFlow 2 examples with a local MNIST stand-in (no download).

``python run_example.py EXAMPLE.py [ARGS...]``: ``mnist.load_data`` (tf-keras's and Keras 3's)
returns a small learnable stand-in: 28x28 uint8 images, each of the 10 classes a fixed random
template plus noise. With ``PHALANX_EXAMPLE_FIT_CAP=EPOCHS,STEPS`` (a test's budget) every
``Model.fit`` runs at most that many epochs of that many steps; nothing else in the example
changes. Everything else (the script, its arguments) is the example's own.
"""

import os
import runpy
import sys

import numpy as np


def _mnist(path="mnist.npz"):
    rng = np.random.default_rng(1)
    templates = rng.integers(0, 256, (10, 28, 28))
    labels = rng.integers(0, 10, 2048)
    images = np.clip(templates[labels] * 0.7 + rng.integers(0, 77, (2048, 28, 28)), 0, 255).astype("uint8")
    return (images[:1536], labels[:1536].astype("uint8")), (images[1536:], labels[1536:].astype("uint8"))


def _cap_fit(model_class, epochs_cap, steps_cap):
    fit = model_class.fit

    def capped(self, *args, **kwargs):
        kwargs["epochs"] = min(kwargs.get("epochs", 1), epochs_cap)
        if kwargs.get("steps_per_epoch") is not None:
            kwargs["steps_per_epoch"] = min(kwargs["steps_per_epoch"], steps_cap)
        return fit(self, *args, **kwargs)

    model_class.fit = capped


def main():
    import tensorflow as tf

    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        import tf_keras as keras_module
    else:
        import keras as keras_module
    keras_module.datasets.mnist.load_data = _mnist
    tf.keras.datasets.mnist.load_data = _mnist
    cap = os.environ.get("PHALANX_EXAMPLE_FIT_CAP")
    if cap:
        epochs_cap, steps_cap = (int(x) for x in cap.split(","))
        _cap_fit(keras_module.Model, epochs_cap, steps_cap)
    example = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
