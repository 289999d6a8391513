"""Hide triton from torch: triton's LLVM loaded after TensorFlow's aborts the process (a baseline
without phalanx's own guard in runtime.import_dynamo_first would die at hvd.init())."""

import sys

sys.modules.setdefault("triton", None)
