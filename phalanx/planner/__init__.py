"""Planner: predict a step's time before running it, choose a layout, tune online.

- :mod:`~phalanx.planner.cost`: alpha-beta cost model (ring, hierarchical, compressed
  allreduce, ZeRO, pipeline bubble, tensor parallel, Amdahl) and its calibration.
- :mod:`~phalanx.planner.plan`: ``phalanx plan``, enumerate dp/pp/tp/ZeRO/compression/bucket
  layouts under a memory budget and rank them by predicted step time.
- :mod:`~phalanx.planner.autotune`: tune the fusion (bucket) size during the first steps.
- :mod:`~phalanx.planner.hardware`: GPU / node / network profiles (P100, V100, A100, H100; this
  machine measured); :mod:`~phalanx.planner.workloads`: models sized from their layers;
  :mod:`~phalanx.planner.scaling`: the step at cluster scale and ``phalanx plan --hardware``;
  :mod:`~phalanx.planner.kernels`: a transformer's compute on H100-class GPUs from measured kernel times;
  :mod:`~phalanx.planner.published`: published results the model reproduces (docs/scaling.md);
  :mod:`~phalanx.planner.megatron`: Megatron-Core's data-parallel step as its code runs it (a contrast for the
  Megatron-LM rows).

Example::

    from phalanx.planner import cost
    cost.amdahl(0.6, 10)   # 2.17
"""

from phalanx.planner import cost

__all__ = ["cost"]
