"""Seed 000's tf.distribute example: MultiWorkerMirroredStrategy, run by ``phalanx run`` unedited.

``phalanx run`` exports TF_CONFIG for each worker (phalanx/launcher/tf_config.py), so the
strategy finds its peers; nothing in this script knows about phalanx. The seed's model
(Dense 64 relu, Dense 10, Adam, sparse categorical cross-entropy from logits) trains on
scikit-learn's digits; each worker prints its final weights' checksum so a test can
check that the replicas agree.

Keras 3's ``model.fit`` does not run under MultiWorkerMirroredStrategy (keras-team/keras#20585:
it cannot reduce the first distributed batch); the seed's ``tf.keras`` code is Keras 2 code,
which TensorFlow runs with the ``tf-keras`` package and ``TF_USE_LEGACY_KERAS=1``::

    TF_USE_LEGACY_KERAS=1 phalanx run -np 2 python examples/keras_seed_000_mwms.py
"""

import json
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(64)
history = model.fit(dataset, epochs=int(os.environ.get("EPOCHS", "3")), verbose=0)

task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
checksum = float(sum(np.abs(w).sum() for w in model.get_weights()))
print(f"worker {task.get('index', 0)} of {strategy.num_replicas_in_sync}: "
      f"loss {history.history['loss'][-1]:.4f} accuracy {history.history['accuracy'][-1]:.3f} "
      f"weights {checksum:.6f}")
