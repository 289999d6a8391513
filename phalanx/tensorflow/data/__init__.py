"""Horovod's ``horovod.tensorflow.data``: tf.data service workers in a compute job of their own
(:mod:`phalanx.tensorflow.data.compute_service`, started by ``python -m phalanx.tensorflow.data.compute_worker``)."""
