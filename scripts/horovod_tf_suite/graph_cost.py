"""The cost of a ``tf.compat.v1`` graph collective on phalanx, per run and per new collective (issue 39).

``phalanx run -np 2 python graph_cost.py [NEW]``: (a) one allreduce of one float run ``RUNS`` times, the
mean time of a run; (b) ``NEW`` allreduces built in a loop, each run once right after it is built
(Horovod's ``test_horovod_broadcast_inplace_cpu`` pattern), the total time. Run it with
``PYTHONPATH`` at two trees to compare them (docs/keras.md, "Graph mode").
"""

import sys
import time

import tensorflow as tf

import phalanx.tensorflow as hvd

RUNS = 50
NEW = int(sys.argv[1]) if len(sys.argv) > 1 else 48


def main() -> None:
    hvd.init()
    tf.compat.v1.disable_eager_execution()
    r = hvd.rank()
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        op = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        session.run(op)
        start = time.perf_counter()
        for _ in range(RUNS):
            session.run(op)
        per_run = (time.perf_counter() - start) / RUNS
        start = time.perf_counter()
        for i in range(NEW):
            session.run(hvd.allreduce(tf.constant([float(r + i)]), op=hvd.Sum))
        new = time.perf_counter() - start
    print(f"rank {r}: {per_run * 1e3:.2f} ms a run; {NEW} new collectives run once each: {new:.2f} s", flush=True)


if __name__ == "__main__":
    main()
