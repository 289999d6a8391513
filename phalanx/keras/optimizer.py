"""``DistributedOptimizer`` for Keras 3: average gradients across ranks, then apply them.

A Keras optimizer that holds the user's optimizer and delegates to it (the shape of
Keras's own ``LossScaleOptimizer``; no class is built at run time, unlike Horovod's
``type(...)`` subclass). ``model.compile`` accepts it like any optimizer and
``model.save`` / :func:`phalanx.keras.load_model` round-trip it.

One step, as Keras calls it (``optimizer.apply(grads, variables)``)::

    grads ─┬─ backward_passes_per_step == 1 ───────────────────────────┐
           └─ else: accumulate; pass k of k? ── no: done               │
                                              └─ yes: sum (/k if       │
                                                 average_aggregated)   │
                                                                       v
    fused, bucketed allreduce (phalanx.keras.fused) ──> inner.apply(averaged, variables)

On the torch backend the gradients are torch tensors and go to phalanx's collectives
as they are; on TensorFlow they cross by DLPack inside one ``tf.py_function`` (no copy;
``phalanx.keras.tensors``); on JAX through one ``io_callback`` out of the jitted step
(NumPy views on the host, no copy on the way in).

``backward_passes_per_step=k``: the update is the sum of the k local gradients (Horovod's
default) or their mean with ``average_aggregated_gradients=True``; one allreduce per k
passes. ``iterations`` counts updates, as with Keras's own ``gradient_accumulation_steps``
(Horovod's TF optimizer counted every pass, which shifts Adam's bias correction; here
2 ranks x k passes of B samples give exactly one process's step on 2kB samples).

Example::

    import keras, phalanx.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()), compression=hvd.Compression.fp16)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import keras
from keras import ops

import phalanx.runtime as runtime
from phalanx.comm.collectives import Average, ReduceOp
from phalanx.comm.compression.codecs import NoneCompressor, get_compressor
from phalanx.keras.arguments import check_reduction, legacy_arguments
from phalanx.keras.fused import DEFAULT_BUCKET_MB, reduce_gradients
from phalanx.keras.legacy_check import same_gradients
from phalanx.keras.torch_backward import BackwardOverlap

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]


def _compression_name(compression) -> str | None:
    if compression is None or isinstance(compression, str):
        return compression
    return getattr(compression, "name", None)


@keras.saving.register_keras_serializable(package="phalanx")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap ``optimizer`` so that each update uses gradients averaged over every rank.

    Args follow ``horovod.keras.DistributedOptimizer``: ``compression`` (a
    ``Compression`` member or any phalanx compressor name: ``"fp16"``, ``"int8"``,
    ``"topk"``, …), ``backward_passes_per_step``, ``average_aggregated_gradients``,
    ``gradient_predivide_factor`` (divide by f before the sum and by size/f after;
    needs ``op=Average``), ``op`` (``Average`` or ``Sum``), ``num_groups`` (fuse into
    that many buckets); ``bucket_mb`` sets the bucket size directly. ``device_dense``,
    ``device_sparse`` and ``sparse_as_dense`` are accepted; sparse gradients are always
    reduced dense.

    A tf-keras (Keras 2) optimizer, as Keras 2 code under ``TF_USE_LEGACY_KERAS=1`` makes,
    gets the tf-keras form of this optimizer (:mod:`phalanx.keras.legacy`), which tf-keras's
    ``model.compile`` accepts.
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        from phalanx.keras.legacy_check import is_tf_keras_optimizer

        if is_tf_keras_optimizer(optimizer):
            from phalanx.keras.legacy import distributed_tf_keras_optimizer

            return distributed_tf_keras_optimizer(optimizer, *legacy_arguments(args, kwargs))
        return super().__new__(cls)

    def __init__(self, optimizer, name=None, device_dense="", device_sparse="", compression=None,
                 sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None, bucket_mb=None, **kwargs):
        if kwargs.pop("process_set", None) is not None:
            raise ValueError("phalanx.keras.DistributedOptimizer: process_set is not supported; "
                             "every rank of the job takes part")
        if kwargs:
            raise ValueError(f"phalanx.keras.DistributedOptimizer got unknown arguments {sorted(kwargs)}; "
                             "set optimizer options on the optimizer you wrap")
        if isinstance(optimizer, (str, dict)):
            optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a phalanx.keras.DistributedOptimizer; wrap it only once")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            hint = ("for torch.optim use phalanx.horovod.DistributedOptimizer" if type(optimizer).__module__.startswith(
                "torch") else "pass a Keras 3 or a tf-keras (TF_USE_LEGACY_KERAS=1) optimizer")
            raise TypeError(f"phalanx.keras.DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                            f"{type(optimizer).__module__}.{type(optimizer).__name__}; {hint}")
        op = check_reduction(backward_passes_per_step, op, gradient_predivide_factor)
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.op = op
        self.inner_optimizer = optimizer
        self.compression = get_compressor(compression)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.num_groups = len(groups) if isinstance(groups, (list, tuple)) else int(groups or num_groups or 0)
        self.bucket_mb = bucket_mb
        self.sparse_as_dense = sparse_as_dense
        self.local_variable_ids: set[int] = set()  # PartialDistributedOptimizer's local layers' weights
        self._overlap = None

    def register_local_var(self, var):
        """Keep ``var``'s gradient on this rank, divided by the number of ranks (Horovod's ``register_local_var``).

        Example::

            opt.register_local_var(model.layers[-1].kernel)
        """
        if self._overlap is not None:
            raise ValueError("register_local_var: call it before the first training step")
        self.local_variable_ids.add(id(var))

    # ---------------------------------------------------------------- state
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self._passes = self.add_variable(shape=(), dtype="int", initializer="zeros", aggregation="none",
                                             name="backward_passes")
            self._accumulated = [self.add_variable_from_reference(v, name="accumulated_grad") for v in var_list]
        super().build(var_list)
        self._bucket_mb_value = self._bucket_mb()
        if (keras.backend.backend() == "torch" and runtime.size() > 1 and self.backward_passes_per_step == 1
                and isinstance(self.compression, NoneCompressor) and self.gradient_predivide_factor == 1.0
                and not self.local_variable_ids):
            # launch the buckets from backward (armed by scale_loss, which Keras's torch train_step calls)
            self._overlap = BackwardOverlap([v.value for v in var_list], bucket_mb=self._bucket_mb_value,
                                            average=self.op is ReduceOp.AVERAGE, name=f"{self.name}.grads")

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        if self._overlap is not None:
            self._overlap.arm()
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def __getattr__(self, name):
        # Hyper-parameters of the wrapped optimizer (momentum, beta_1, …) read through, as on Horovod's subclass.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)

    # ---------------------------------------------------------------- the step
    def _bucket_mb(self) -> float:
        if self.bucket_mb is not None:
            return float(self.bucket_mb)
        if self.num_groups:
            total = sum(math.prod(v.shape) * 4 for v in self._trainable_variables)
            return max(total / self.num_groups / 2**20, 1e-3)
        return DEFAULT_BUCKET_MB

    def _reduce(self, grads, variables=None):
        if self.local_variable_ids and variables is not None:
            local = [id(v) in self.local_variable_ids for v in variables]
            reduced = self._reduce([None if is_local else g for g, is_local in zip(grads, local)])
            size = float(runtime.size())
            return [r if not is_local else (None if g is None else g / size)
                    for g, r, is_local in zip(grads, reduced, local)]
        return reduce_gradients(grads, average=self.op is ReduceOp.AVERAGE, compression=self.compression,
                                bucket_mb=self._bucket_mb_value, predivide=self.gradient_predivide_factor,
                                name=f"{self.name}.grads")

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not self.built:
            if trainable_variables is None:
                raise ValueError("DistributedOptimizer.apply: pass trainable_variables on the first call "
                                 "(or call optimizer.build(model.trainable_variables) first)")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        overlap = self._overlap
        if overlap is not None and overlap.armed:
            if overlap.covers([v.value for v in variables]):  # the buckets were launched from backward
                averaged = overlap.finish()
                self.inner_optimizer.apply([None if g is None else a for g, a in zip(grads, averaged)], variables)
                return
            overlap.finish()  # other variables than the model's: complete what backward launched, then reduce

        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(self._reduce(grads, variables), variables)
            return
        k = self.backward_passes_per_step
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}
        accumulators = [self._accumulated[index[id(v)]] for v in variables]
        if keras.backend.backend() == "jax":
            self._accumulate_without_branches(grads, variables, accumulators)
            return
        for acc, g in zip(accumulators, grads):
            if g is not None:
                acc.assign_add(ops.convert_to_tensor(g, dtype=acc.dtype))
        self._passes.assign_add(1)

        def update():
            summed = [None if g is None else acc.value for acc, g in zip(accumulators, grads)]
            if self.average_aggregated_gradients:
                summed = [None if s is None else s / k for s in summed]
            self.inner_optimizer.apply(self._reduce(summed, variables), variables)
            for acc in accumulators:
                acc.assign(ops.zeros_like(acc))
            self._passes.assign(0)

        ops.cond(ops.equal(self._passes, k), update, lambda: None)

    def apply_gradients(self, grads_and_vars, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if same_gradients(self.__dict__.pop("_prepared", None), grads_and_vars):
            self._apply_prepared(grads_and_vars)
            return self.iterations
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    # ------------------------------------------- Horovod's private names (compatibility aliases)
    @property
    def _agg_helper(self):
        """Horovod's ``opt._agg_helper``: None when ``backward_passes_per_step`` is 1, else an object
        whose ``counter`` is the variable holding the passes summed since the last update."""
        if self.backward_passes_per_step == 1:
            return None
        if not self.built:
            raise ValueError("DistributedOptimizer._agg_helper: the optimizer is built on its first step; "
                             "read the counter after it (or call optimizer.build(variables) first)")
        return SimpleNamespace(counter=self._passes, backward_passes_per_step=self.backward_passes_per_step)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's ``opt._compute_gradients`` (TensorFlow backend): this rank's gradients of ``loss`` (a
        callable, or a tensor recorded on ``tape``) reduced over the ranks, as ``(gradient, variable)`` pairs.

        With ``backward_passes_per_step=k`` > 1 the pass is summed locally; the k-th pass returns the
        reduced sums (means with ``average_aggregated_gradients``), the others the running sums.
        ``apply_gradients`` of exactly these pairs applies them without a second reduction, on the k-th
        pass only, and counts every pass in ``iterations``, as Horovod's optimizer did (phalanx's own
        path, ``fit`` / ``apply``, reduces in ``apply`` and counts updates). ``grad_loss`` is ignored,
        as Horovod's Keras optimizers do.
        """
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"DistributedOptimizer._compute_gradients (Horovod's private name) needs "
                             f"KERAS_BACKEND=tensorflow, got {keras.backend.backend()!r}; call optimizer.apply(grads)")
        import tensorflow as tf

        if tape is None:
            if not callable(loss):
                raise ValueError("DistributedOptimizer._compute_gradients: pass the tape that recorded a tensor "
                                 "loss (tape=...), or a callable loss")
            tape = tf.GradientTape()
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
        variables = list(var_list() if callable(var_list) else var_list)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        k = self.backward_passes_per_step
        if k == 1:
            out = self._reduce(grads, variables)
        else:
            index = {id(v): i for i, v in enumerate(self._trainable_variables)}
            accumulators = [self._accumulated[index[id(v)]] for v in variables]
            present = [i for i, g in enumerate(grads) if g is not None]
            for i in present:
                accumulators[i].assign_add(tf.cast(grads[i], accumulators[i].dtype))
            self._passes.assign_add(1)

            def update():
                summed = [accumulators[i].value for i in present]
                if self.average_aggregated_gradients:
                    summed = [g / k for g in summed]
                reduced = self._reduce(summed, [variables[i] for i in present])
                with tf.control_dependencies(reduced):
                    for acc in accumulators:
                        acc.assign(tf.zeros_like(acc.value))
                    self._passes.assign(0)
                return [tf.identity(g) for g in reduced]

            sums = tf.cond(tf.equal(self._passes.value, k), update,
                           lambda: [tf.identity(accumulators[i].value) for i in present])
            out = [None] * len(grads)
            for i, g in zip(present, sums):
                out[i] = g
        self.__dict__["_prepared"] = out  # outside Keras's attribute tracking; apply_gradients pops it
        return list(zip(out, variables))

    def _apply_prepared(self, grads_and_vars):
        """``apply_gradients`` of :meth:`_compute_gradients`'s pairs: already reduced; with k > 1 an update
        when the pass counter was just reset (the k-th pass), else one more iteration."""
        import tensorflow as tf

        grads = [g for g, _ in grads_and_vars if g is not None]
        variables = [v for g, v in grads_and_vars if g is not None]
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(grads, variables)
            return

        def update():
            self.inner_optimizer.apply(grads, variables)
            return tf.constant(True)

        def count():
            self.inner_optimizer.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(self._passes.value, 0), update, count)

    def _accumulate_without_branches(self, grads, variables, accumulators):
        """JAX: ``backward_passes_per_step`` without ``cond`` (a stateless step cannot assign inside one).

        Every pass computes the update and keeps it only on pass k (``where``), as Keras's
        own ``JaxOptimizer`` does for ``gradient_accumulation_steps``; the collective runs
        on pass k only (the host call is told whether this is the one).
        """
        k = self.backward_passes_per_step
        passes = self._passes.value + 1
        is_update = ops.equal(passes, k)
        summed = [None if g is None else acc.value + ops.convert_to_tensor(g, dtype=acc.dtype)
                  for acc, g in zip(accumulators, grads)]
        ready = [None if s is None else (s / k if self.average_aggregated_gradients else s) for s in summed]
        reduced = reduce_gradients(ready, average=self.op is ReduceOp.AVERAGE, compression=self.compression,
                                   bucket_mb=self._bucket_mb_value, predivide=self.gradient_predivide_factor,
                                   name=f"{self.name}.grads", when=is_update)
        state = list(variables) + list(self.inner_optimizer.variables)
        before = [v.value for v in state]
        self.inner_optimizer.apply(reduced, variables)
        for v, old in zip(state, before):
            v.assign(ops.where(is_update, v.value, old))
        for acc, s in zip(accumulators, summed):
            if s is not None:
                acc.assign(ops.where(is_update, ops.zeros_like(s), s))
        self._passes.assign(ops.where(is_update, ops.zeros_like(passes), passes))

    # ---------------------------------------------------------------- saving
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": _compression_name(self.compression),
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "op": self.op.value,
            "num_groups": self.num_groups,
            "bucket_mb": self.bucket_mb,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
                                process_set=None, local_layers=None, scale_local_gradients=True):
    """A :class:`DistributedOptimizer` that leaves the gradients of ``local_layers``' weights on each rank.

    Local gradients are divided by the number of ranks (``scale_local_gradients``, Horovod's choice).

    Example::

        opt = hvd.PartialDistributedOptimizer(keras.optimizers.Adam(), local_layers=[model.layers[-1]])
    """
    from phalanx.keras.legacy_check import is_tf_keras_optimizer, local_weights

    local = local_weights(local_layers, "PartialDistributedOptimizer")

    if is_tf_keras_optimizer(optimizer):
        from phalanx.keras.legacy import distributed_tf_keras_optimizer

        return distributed_tf_keras_optimizer(optimizer, name, get_compressor(compression), op, backward_passes_per_step,
                                              average_aggregated_gradients, gradient_predivide_factor,
                                              local_variables=local, scale_local_gradients=scale_local_gradients)
    if not scale_local_gradients:
        raise ValueError("PartialDistributedOptimizer: scale_local_gradients=False is not supported on Keras 3 "
                         "optimizers; local gradients are divided by the number of ranks")
    opt = DistributedOptimizer(optimizer, name=name, compression=compression,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               backward_passes_per_step=backward_passes_per_step,
                               average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                               process_set=process_set)
    opt.local_variable_ids = {id(v) for v in local}
    return opt
