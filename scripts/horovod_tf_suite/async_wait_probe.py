"""Which TensorFlow graph ops can wait for each other without holding an inter-op thread (issue 39).

``python async_wait_probe.py N py|iter``: a ``tf.compat.v1`` session with 2 inter-op threads runs N
ops that each wait (a ``threading.Barrier``) until all N have started. ``py``: each op is a
``tf.py_function`` (what phalanx's graph collectives are): it holds an inter-op thread while it
waits, so N > 2 deadlocks (the barrier's 20 s timeout ends it with ``UnknownError``). ``iter``:
each op is ``get_next()`` of a one-shot iterator over ``Dataset.from_generator`` whose generator
waits: the op is asynchronous and the wait runs on tf.data's side, so N = 64 completes. Measured on
cpu2 (TF 2.21): ``py`` N=3 deadlocks; ``iter`` N=4, 16 and 64 complete, three runs each. The
building block a run-time order of graph collectives needs (docs/keras.md, "Graph mode").
"""

import sys
import threading
import time

import tensorflow as tf


def main(n: int, mode: str) -> None:
    tf.compat.v1.disable_eager_execution()
    barrier = threading.Barrier(n, timeout=20)

    def wait() -> float:
        barrier.wait()
        return 1.0

    outs = []
    for _ in range(n):
        if mode == "py":
            outs.append(tf.py_function(lambda: tf.constant(wait()), [], tf.float32))
        else:
            def endless():
                while True:
                    yield wait()

            dataset = tf.data.Dataset.from_generator(endless, output_signature=tf.TensorSpec([], tf.float32))
            outs.append(tf.compat.v1.data.make_one_shot_iterator(dataset).get_next())
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=2)
    with tf.compat.v1.Session(config=config) as session:
        start = time.time()
        try:
            for run in range(3):
                session.run(outs)
                print(f"{mode} N={n}: run {run} complete after {time.time() - start:.2f} s", flush=True)
        except tf.errors.OpError as err:
            print(f"{mode} N={n}: {type(err).__name__} (deadlocked until the barrier's timeout)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
