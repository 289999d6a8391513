"""One rank of tests/runtime/test_backends.py: adopt a gloo group connected in the background as the
default group (``phalanx_staged``, as an elastic admission does), then use paths that pick by engine."""

import json
import os
import sys

import torch
import torch.distributed as dist

from phalanx.elastic import staging

rank, path = int(sys.argv[1]), sys.argv[2]
store = dist.FileStore(path, 2)
staging.adopt(staging.connect(store, 1, rank, 2, 60), store, 1, rank, 2, 60)
os.environ.update(RANK=str(rank), WORLD_SIZE="2")

import phalanx as px  # noqa: E402
import phalanx.horovod as hvd  # noqa: E402
from phalanx.runtime.backends import engine  # noqa: E402

hvd.init()
out = {"name": dist.get_backend(), "engine": engine(), "topology": px.topology().backend}
for dtype in (torch.int16, torch.uint16):  # gloo has neither: they travel as int32
    got = hvd.allreduce(torch.tensor([1, 2, 300], dtype=dtype) * (rank + 1), op=hvd.Sum)
    out[str(dtype)] = [str(got.dtype), got.tolist()]
print(json.dumps(out), flush=True)
