"""What each strategy runs and composes with, written down once, as data.

The strategies check their arguments against it and the planner searches it, so a
layout ``phalanx plan`` recommends is one phalanx builds:

- ``px.zero`` refuses a compressor its reduce-scatter cannot sum (:func:`accepts_compressor`);
- ``parallelize(data_parallel=...)`` takes its names from :data:`DATA_AXES`;
- ``phalanx.planner`` enumerates :func:`data_axis_options` and prices each entry's
  :class:`Traffic` (it imports this module; this module imports nothing of phalanx).

Each data-parallel entry says what it shards (memory) and which collectives it issues
in a step (traffic). A new strategy adds its entry and its traffic here; expert
parallel, for one, would add an ``ep`` axis and its all-to-alls as ``Traffic`` rows::

    strategy        shards over dp            traffic per step (m micro-batches)
    DataParallel    nothing                   allreduce(grads) in buckets, under the last backward
    ZeRO-1          optimizer                 reduce_scatter(grads) under the last backward; all_gather(params) after step
    ZeRO-2          + gradients               reduce_scatter(grads) under every backward (x m); all_gather(params) after step
    ZeRO-3          + parameters              all_gather(params) in every forward and backward, prefetched one module
                                              ahead (x 2m); reduce_scatter(grads) under every backward (x m)
    tensor (tp)     weights of split layers   Megatron f/g: 2 allreduce(activations) per block forward, 2 backward
    pipeline (pp)   blocks                    one send of the activations and one of their gradient per micro-batch

Example::

    from phalanx.parallel import composition
    opts = composition.data_axis_options({"none": True, "int8": False}, model_parallel=False)
    [(o.axis.name, o.compression, o.algorithm) for o in opts]   # DataParallel takes int8; ZeRO does not
    composition.accepts_compressor("zero1", summable=False)     # False: a reduce-scatter cannot sum int8
"""

from __future__ import annotations

import dataclasses

__all__ = ["Traffic", "DataAxis", "DataAxisOption", "DATA_AXES", "DATA_PARALLEL_NAMES", "TENSOR_TRAFFIC",
           "PIPELINE_TRAFFIC", "MODEL_PARALLEL_ALGORITHMS", "ZERO_SCHEDULES", "by_name", "accepts_compressor",
           "data_axis_options", "tied_across_stages"]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One collective a strategy issues, as the planner prices it."""

    op: str
    """"allreduce", "reduce_scatter", "all_gather" or "send_recv" (expert parallel would add "all_to_all")"""
    axis: str
    """the mesh axis it runs over: "dp", "tp" or "pp\""""
    payload: str
    """what it moves: "grads", "params" (compute dtype) or "activations" (one micro-batch's b x s x h)"""
    per: str = "step"
    """how often: "step", "micro_batch" (every forward/backward pass) or "block" (per block, per micro-batch)"""
    count: int = 1
    """how many of it per ``per``"""
    hides_behind: str = "none"
    """the compute it overlaps: "backward" (bucketed, launched as backward fills them), "forward" (prefetched
    one module ahead), or "none" (on the critical path)"""
    compressed: bool = False
    """the strategy's gradient compression applies to it"""


@dataclasses.dataclass(frozen=True)
class DataAxis:
    """One way to run the data-parallel axis: its name, what it shards, what it sends."""

    name: str
    """as ``parallelize(data_parallel=...)`` spells it"""
    zero: int
    """ZeRO stage (0: plain data parallel)"""
    shards: tuple[str, ...]
    """what it splits over the dp ranks: "optimizer", "grads", "params\""""
    compressors: str
    """which gradient compressors it can send: "any" (DataParallel: allreduce or allgather paths) or
    "summable" (ZeRO: a reduce-scatter sums the payloads on the wire)"""
    algorithms: tuple[str, ...]
    """allreduce algorithms its gradients can take alone on the dp axis (``DataParallel(algorithm=)``);
    ZeRO's reduce-scatter and all-gather are the backend's own"""
    traffic: tuple[Traffic, ...]
    entry: str
    """the call that builds it on a plain data-parallel job"""


DATA_AXES: tuple[DataAxis, ...] = (
    DataAxis("allreduce", 0, (), "any", ("flat", "hierarchical"),
             (Traffic("allreduce", "dp", "grads", hides_behind="backward", compressed=True),),
             "px.DataParallel(model, compression=..., algorithm=...)"),
    DataAxis("zero1", 1, ("optimizer",), "summable", (),
             (Traffic("reduce_scatter", "dp", "grads", hides_behind="backward", compressed=True),
              Traffic("all_gather", "dp", "params")),
             "px.zero(model, optimizer, stage=1, compression=...)"),
    DataAxis("zero2", 2, ("optimizer", "grads"), "summable", (),
             (Traffic("reduce_scatter", "dp", "grads", per="micro_batch", hides_behind="backward", compressed=True),
              Traffic("all_gather", "dp", "params")),
             "px.zero(model, optimizer, stage=2, compression=...)"),
    DataAxis("zero3", 3, ("optimizer", "grads", "params"), "summable", (),
             (Traffic("all_gather", "dp", "params", per="micro_batch", hides_behind="forward"),
              Traffic("all_gather", "dp", "params", per="micro_batch", hides_behind="backward"),
              Traffic("reduce_scatter", "dp", "grads", per="micro_batch", hides_behind="backward", compressed=True)),
             "px.zero(model, optimizer, stage=3, compression=...)"),
)
"""Every data-parallel strategy, plain first."""

DATA_PARALLEL_NAMES: tuple[str, ...] = ("auto",) + tuple(a.name for a in DATA_AXES)
"""``parallelize(data_parallel=...)``: "auto" (DataParallel when installed) or an entry of DATA_AXES"""

TENSOR_TRAFFIC: tuple[Traffic, ...] = (
    Traffic("allreduce", "tp", "activations", per="block", count=2),                    # g after attention and MLP
    Traffic("allreduce", "tp", "activations", per="block", count=2),                    # f's gradient in backward
)
"""Megatron tensor parallel (phalanx.parallel.tensor: no sequence parallel): 2 allreduces of b x s x h per
block forward, 2 backward; activation recomputation repeats the forward's 2."""

PIPELINE_TRAFFIC: tuple[Traffic, ...] = (
    Traffic("send_recv", "pp", "activations", per="micro_batch", count=2),             # activation on, gradient back
)
"""Between neighbouring stages, per micro-batch: the activation forward and its gradient back."""

MODEL_PARALLEL_ALGORITHMS: tuple[str, ...] = ("flat",)
"""Under ``parallelize`` with tp or pp > 1 the dp group is a sub-group: "hierarchical" reduces over the
whole world only (phalanx.comm.algorithms), and ``parallelize`` passes no compression to DataParallel."""

ZERO_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "eager_1f1b")
"""Pipeline schedules ZeRO composes with: an interleaved one reduces in a last backward that reaches one
chunk only, so ``parallelize`` refuses it."""


def tied_across_stages(name: str, stages: tuple[int, ...], data_parallel: str) -> str:
    """The one line ZeRO refuses a pipeline stage with a parameter tied across stages (a head tied to the
    embedding, as HF GPT-2 and small Llamas build it) when it is not given the pipeline's group. Without
    ZeRO the pipeline keeps a copy on each stage that uses it and sums their gradients after every step
    (Megatron-LM's tied embedding); ZeRO reduce-scatters each copy's gradient into its own stage's
    shards during backward, so it sums the copies' shards itself, over ``tied_group``
    (``parallelize`` passes ``RankGrid.pp_group``)."""
    return (f"{data_parallel}: parameter {name} is tied across pipeline stages {', '.join(map(str, stages))}, whose "
            "gradients ZeRO must sum over the pipeline after sharding them; pass tied_group= the pipeline's "
            "process group (RankGrid.pp_group), or build the model untied (HF: tie_word_embeddings=False)")


def by_name(name: str) -> DataAxis:
    for axis in DATA_AXES:
        if axis.name == name:
            return axis
    raise ValueError(f"data_parallel={name!r}: use one of {', '.join(map(repr, DATA_PARALLEL_NAMES))}")


def accepts_compressor(name: str, summable: bool, compressor: str = "") -> bool:
    """Whether the data-parallel strategy ``name`` can send a compressor (``summable``: payloads of
    different ranks add up on the wire; ``compressor``: its registered name, "none" always accepted)."""
    axis = by_name(name)
    return compressor == "none" or axis.compressors == "any" or summable


@dataclasses.dataclass(frozen=True)
class DataAxisOption:
    """One runnable (strategy, compressor, algorithm) choice for the dp axis."""

    axis: DataAxis
    compression: str
    algorithm: str


def data_axis_options(compressors: dict[str, bool], *, model_parallel: bool) -> list[DataAxisOption]:
    """Every data-parallel choice phalanx builds, for the compressors the caller can price
    (``{name: summable}``). ``model_parallel``: tp or pp > 1 (``parallelize``), where DataParallel
    sends uncompressed gradients with the backend's own allreduce."""
    out = []
    for axis in DATA_AXES:
        algorithms = axis.algorithms or ("flat",)
        if model_parallel:
            algorithms = tuple(a for a in algorithms if a in MODEL_PARALLEL_ALGORITHMS)
        for name, summable in compressors.items():
            if model_parallel and name != "none":
                continue
            if not accepts_compressor(axis.name, summable, name):
                continue
            out += [DataAxisOption(axis, name, alg) for alg in algorithms]
    return out
