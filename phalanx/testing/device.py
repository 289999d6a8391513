"""Run a test body with its tensors on a GPU and its random numbers drawn as on the CPU.

``PHALANX_TEST_DEVICE=cuda`` reruns the suite's rank bodies on CUDA (:func:`on_device`). A body
written for the CPU must then build its model and batches on the GPU unchanged, and three things
would make such a run differ from the CPU run for reasons that have nothing to do with phalanx;
:class:`DeviceUnderTest` takes them away:

- **Where the test's tensors are made.** A factory call without ``device=`` made by the test's
  own code (``torch.randn``) or by a module it builds (``nn.Linear``'s ``torch.empty``) makes its
  tensor on the device.
- **Where everything else is made: as a user's run would.** The same call made by phalanx's
  library code, or by torch's own bookkeeping (an optimizer's step count, a sampler's seed), is
  left alone and makes a CPU tensor, exactly as in a user's CUDA run. (A global
  ``torch.set_default_device("cuda")`` would move those too and hide the very bug this run looks
  for: a CPU tensor from library code meeting a CUDA gradient.) Who called is read off the
  stack: the immediate caller, and the first frame outside torch; ``phalanx.models`` and
  ``phalanx.testing`` count as the test's.
- **Which random numbers the test gets.** The CUDA generator draws other numbers than the CPU's
  for the same seed, and a body seeds ``torch.Generator()`` (a CPU generator) that a CUDA
  factory refuses. So every random draw the test's code asks for (``torch.randn``, ``randperm``,
  ``nn.init``, a DataLoader's seed) is made on the CPU from the generator the CPU run would use
  and copied to the device: weights and batches are the CPU run's, bit for bit. Random kernels
  inside torch's own ops (dropout) still use the GPU's.

TF32 is turned off so that fp32 products compare with references computed on the CPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

__all__ = ["DeviceUnderTest", "on_device", "to_cpu"]

# Factories that draw random numbers: made on the CPU, then moved.
_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm}
# Functions of a tensor that draw random numbers: computed on a CPU copy, then moved back.
_RANDOM_OF_TENSOR = {torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli,
                     torch.multinomial, torch.poisson}
# In-place fills with random numbers (nn.init, DataLoader's base seed): drawn on the CPU, copied in.
# nn.init's functions come here whole (the mode is off inside a function it handles), so they are
# listed beside the tensor methods they call.
_RANDOM_IN_PLACE = {torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
                    torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.geometric_,
                    torch.Tensor.log_normal_, torch.Tensor.cauchy_,
                    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
                    nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
                    nn.init.orthogonal_, nn.init.sparse_}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PHALANX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# model state: modules' parameters and buffers (lazy modules materialise theirs in nn/parameter.py)
_MODEL_STATE = (os.path.join(_TORCH_DIR, "nn", "modules") + os.sep, os.path.join(_TORCH_DIR, "nn", "parameter.py"))
_TEST_SIDE = tuple(_PHALANX_DIR + d + os.sep for d in ("models", "testing"))


def _callers() -> tuple[str, str | None]:
    """(file of the immediate caller of the torch function, file of the first caller outside torch)."""
    frame = sys._getframe(2)  # past _callers and __torch_function__
    immediate = frame.f_code.co_filename
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return immediate, frame.f_code.co_filename if frame is not None else None


def _library(name: str | None) -> bool:
    return name is not None and name.startswith(_PHALANX_DIR) and not name.startswith(_TEST_SIDE)


def _cpu_generator(kwargs: dict) -> bool:
    g = kwargs.get("generator")
    return g is None or g.device.type == "cpu"


class DeviceUnderTest(TorchFunctionMode):
    """The test's tensors on ``device``, drawn as on the CPU (see the module docstring).

    Example::

        with DeviceUnderTest(torch.device("cuda")):
            torch.manual_seed(0)
            w = torch.randn(3)          # on cuda, equal to torch.randn(3) on the CPU after the seed
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.compiler.is_compiling():  # library code being compiled (codec kernels): not the test's tensors;
            return func(*args, **kwargs)   # tracing _callers' frame walk made a compile time out on an H100
        constructor = func in _device_constructors()
        if not (constructor or func in _RANDOM_IN_PLACE or func in _RANDOM_OF_TENSOR):
            return func(*args, **kwargs)
        immediate, outside = _callers()
        if _library(outside):
            return func(*args, **kwargs)
        # made for the test: by its own code or a module it builds, not by torch's bookkeeping
        here = not immediate.startswith(_TORCH_DIR) or immediate.startswith(_MODEL_STATE)
        if func in _RANDOM_FACTORIES and _cpu_generator(kwargs):
            target = kwargs.pop("device", None) or (self.device if here else "cpu")
            return func(*args, device="cpu", **kwargs).to(target)
        if func in _RANDOM_IN_PLACE and _cpu_generator(kwargs):
            out = args[0] if args else kwargs["tensor"]  # nn.init passes it by name
            if out.device.type != "cpu":
                cpu = torch.empty(out.shape, dtype=out.dtype, device="cpu")
                if args:
                    func(cpu, *args[1:], **kwargs)
                else:
                    func(**{**kwargs, "tensor": cpu})
                with torch.no_grad():
                    out.copy_(cpu)
                return out
        if func in _RANDOM_OF_TENSOR and _cpu_generator(kwargs):
            devices = {a.device for a in args if isinstance(a, torch.Tensor)}
            if devices and all(d.type != "cpu" for d in devices):
                moved = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
                return func(*moved, **kwargs).to(devices.pop())
        if constructor and here and kwargs.get("device") is None:
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def on_device(device: torch.device, body: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``body(*args, **kwargs)`` under :class:`DeviceUnderTest`; the result comes back with its
    tensors on the CPU."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with DeviceUnderTest(device):
            return to_cpu(body(*args, **kwargs))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples) moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if type(value) is tuple:
        return tuple(to_cpu(v) for v in value)
    return value
