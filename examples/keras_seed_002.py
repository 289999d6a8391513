"""Seed 002's Horovod + Keras script on phalanx: ``import phalanx.keras as hvd``.

    KERAS_BACKEND=torch      phalanx run -np 2 python examples/keras_seed_002.py
    KERAS_BACKEND=tensorflow phalanx run -np 2 python examples/keras_seed_002.py

The seed trains ResNet-50 on ImageNet from 8 GPUs with ``mpirun -np 8 -hostfile hosts.txt``;
here the seed's head (a dense layer, softmax) on the flattened image trains on
scikit-learn's 8x8 digits. What differs from the seed, line by line:

* ``import phalanx.keras as hvd`` instead of ``import horovod.tensorflow as hvd``, and
  ``keras`` for ``tf.keras`` (Keras 3 runs on torch too); the GPU pinning stays, for the
  TensorFlow backend;
* the data: digits, each rank taking every size-th sample (the seed divided a count);
* ``ModelCheckpoint`` is created on rank 0 only, like the seed's ``TensorBoard`` (the seed
  let every rank write the same file), monitors ``loss`` (there is no validation set, so
  ``save_best_only`` would never save) and, as Keras 3 requires, ends in ``.weights.h5``;
* no ``steps_per_epoch`` in ``fit``: with in-memory arrays Keras 3 runs the second epoch on
  an exhausted iterator when it is given (the seed's generator repeated forever).

Kept as the seed wrote it: ``gradient_predivide_factor=2`` (in Horovod, and here, it splits
the averaging into /2 before the sum and /(size/2) after; it does not set the number of
fusion groups, as the seed's comment says) and ``initial_lr=learning_rate/10`` (Horovod's
warm-up *ends* at ``initial_lr``: it ramps from ``initial_lr/size`` to ``initial_lr``).

Each rank prints its final weights' checksum and its (averaged) metrics, so a test
(tests/fronts/test_keras.py) can check that the replicas agree.
"""

import os

import keras
import numpy as np
from sklearn.datasets import load_digits

import phalanx.keras as hvd

# 1. Initialise (phalanx run / torchrun / SLURM / mpirun variables are all understood)
hvd.init()

# 2. Pin one GPU per process (TensorFlow backend; the torch backend has nothing to pin on CPU)
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")


# 3. Data: this rank's share of the digits
def load_data():
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = keras.utils.to_categorical(digits.target, 10)
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]


# 4. The model: the seed's head (a dense layer, softmax) on the flattened 8x8 image
def build_model(num_classes=10):
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(128, activation="relu")(x)
    predictions = keras.layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=predictions)


# 5. Training settings
batch_size_per_gpu = 32
total_batch_size = batch_size_per_gpu * hvd.size()
learning_rate = 0.5 * hvd.size()  # scaled with the number of workers
epochs = int(os.environ.get("EPOCHS", "8"))

# 6. Data and model
x_train, y_train = load_data()
model = build_model()

# 7. Optimizer (wrapped) and loss
optimizer = keras.optimizers.SGD(learning_rate=learning_rate, momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, gradient_predivide_factor=2)
model.compile(optimizer=optimizer, loss="categorical_crossentropy", metrics=["accuracy"])

# 8. Callbacks
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(warmup_epochs=5, initial_lr=learning_rate / 10),
    keras.callbacks.ModelCheckpoint("./digits_horovod_{epoch}.weights.h5", monitor="loss", save_weights_only=True,
                                    save_best_only=True, verbose=1) if hvd.rank() == 0 else None,
    keras.callbacks.TensorBoard(log_dir="./logs", update_freq="batch") if hvd.rank() == 0 else None,
]
callbacks = [c for c in callbacks if c is not None]

# 9. Train
if hvd.rank() == 0:
    print(f"Starting training with {hvd.size()} workers, total batch size {total_batch_size}")
history = model.fit(
    x_train, y_train,
    batch_size=batch_size_per_gpu,
    epochs=epochs,
    callbacks=callbacks,
    verbose=1 if hvd.rank() == 0 else 0,
)
checksum = float(sum(np.abs(w).astype("float64").sum() for w in model.get_weights()))
print(f"rank {hvd.rank()}: weights {checksum:.6f} loss {history.history['loss'][-1]:.6f} "
      f"accuracy {history.history['accuracy'][-1]:.6f} lr {history.history['lr'][-1]:.6f}")
