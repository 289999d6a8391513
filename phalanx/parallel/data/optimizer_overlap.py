"""The optimizer step overlapped with the gradient reduction, piece by piece.

Without it a data-parallel step is serial at its end: the last bucket's reduction
finishes, then ``optimizer.step()`` reads every parameter, gradient and state tensor
once more. SGD, Adam and AdamW update each element from that element alone, so a
piece of the averaged gradient can be applied the moment it is final, while later
pieces (and later buckets) are still on the wire. This is what torch DDP's
overlapped optimizer (``_apply_optimizer_in_backward``, per bucket) and ZeRO's
per-partition steps do (Rajbhandari et al. 2020, "ZeRO"); here the unit is the
piece that the compressed collectives already decode one at a time
(``phalanx.comm.compression.paths.PIECE_NUMEL``), or the whole bucket on the other paths::

    wire      ──[piece 0]──[piece 1]──[piece 2]──[piece 3]──
    decode               [d0]      [d1]      [d2]      [d3]
    optimizer               [s0]      [s1]      [s2]      [s3]   ◀ was: all of it after d3

How a piece is stepped: the optimizer's own ``step`` runs on detached views of the
parameters' slices, with the matching slices of its state tensors (momentum,
``exp_avg``, ``exp_avg_sq``) and a copy of its step counter, so the arithmetic is
exactly the optimizer's (tests compare bitwise-equal parameters with the plain
step). The counter advances once the whole parameter is stepped. ``optimizer.step()``
afterwards steps only what was not stepped in pieces: a parameter's first step
(its state does not exist yet), parameters outside the buckets (sparse, frozen and
unfrozen later).

Not possible with it, by construction: anything that needs the whole gradient
before the update — ``torch.nn.utils.clip_grad_norm_``, ``GradScaler`` (its
``unscale_``/skip decision) — and optimizers that are not elementwise (LBFGS,
factored or matrix-wise states). Those are refused or must not be used with it.

Example::

    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = px.DataParallel(net, compression="int8", overlap_optimizer=opt)
    loss_fn(model(x), y).backward()    # pieces are stepped as they arrive
    opt.step()                         # steps the rest (first step, params outside buckets)
    opt.zero_grad()
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

__all__ = ["OptimizerOverlap"]

_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class OptimizerOverlap:
    """Steps ``optimizer`` on pieces of parameters whose averaged gradient is final.

    :meth:`step_pieces` takes ``(param, start, stop, grad)`` items: elements
    ``[start, stop)`` of ``param.view(-1)`` and their final gradient ``grad`` (a flat
    tensor of ``stop - start`` values). ``optimizer.step`` is wrapped so that it then
    skips every parameter already stepped this iteration.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> None:
        if type(optimizer) not in _ELEMENTWISE:
            names = ", ".join(c.__name__ for c in _ELEMENTWISE)
            raise TypeError(f"overlap_optimizer: {type(optimizer).__name__} is not supported; the update of a piece "
                            f"must depend on that piece alone ({names}). Pass overlap_optimizer=None and call "
                            "optimizer.step() after backward instead.")
        for group in optimizer.param_groups:
            for flag in ("differentiable", "capturable"):
                if group.get(flag):
                    raise ValueError(f"overlap_optimizer: {flag}=True is not supported; create the optimizer "
                                     f"with {flag}=False")
        self.optimizer = optimizer
        self._groups_key: tuple = ()
        self._group_of_cache: dict[int, dict] = {}
        missing = [i for i, p in enumerate(params) if id(p) not in self._group_of()]
        if missing:
            raise ValueError(f"overlap_optimizer: {len(missing)} trainable parameter(s) of the model (index "
                             f"{missing[:5]}) are not in the optimizer; build it from model.parameters()")
        strided = [i for i, p in enumerate(params) if not p.is_contiguous()]
        if strided:  # its pieces are slices of param.view(-1), which a channels_last weight has not
            raise ValueError(f"overlap_optimizer: {len(strided)} parameter(s) of the model (index {strided[:5]}) "
                             "are not contiguous (channels_last?); keep the model contiguous "
                             "(model.to(memory_format=torch.contiguous_format)) or pass overlap_optimizer=None")
        self._done: dict[int, int] = {}  # id(param) -> elements stepped this iteration
        self._stepped: list[torch.nn.Parameter] = []  # fully stepped this iteration
        step = type(optimizer).step
        # torch wraps every optimizer class's step once with its hook runner; the pieces must not
        # run the user's step hooks (once per piece), the real step() below does.
        self._raw_step = step.__wrapped__ if getattr(step, "hooked", False) else step
        self._user_step = optimizer.step
        overlap = self

        def step(opt, *args, **kwargs):  # a method of the optimizer (LR schedulers re-bind its __func__)
            return overlap._step(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)  # instance attribute: this optimizer only
        self.pieces = 0  # pieces stepped so far (tests, benchmarks)

    def _group_of(self) -> dict[int, dict]:
        """id(param) -> its current param group (``load_state_dict`` replaces the group dicts)."""
        key = tuple(id(g) for g in self.optimizer.param_groups)
        if key != self._groups_key:
            self._groups_key = key
            self._group_of_cache = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        return self._group_of_cache

    def ready(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p`` can be stepped in pieces now: its state exists (after its first step)."""
        group = self._group_of().get(id(p))
        if group is None or not p.is_contiguous():
            return False
        state = self.optimizer.state.get(p)
        if isinstance(self.optimizer, torch.optim.SGD):
            return group["momentum"] == 0 or (state is not None and state.get("momentum_buffer") is not None)
        return bool(state)

    def step_pieces(self, items: Sequence[tuple[torch.nn.Parameter, int, int, torch.Tensor]]) -> None:
        """One optimizer step over these slices (in one call, grouped by param group)."""
        items = [it for it in items if self.ready(it[0])]
        if not items:
            return
        opt = self.optimizer
        groups, state = [], {}
        by_group: dict[int, dict] = {}
        group_of = self._group_of()
        for p, start, stop, grad in items:
            g = group_of[id(p)]
            fake = by_group.get(id(g))
            if fake is None:
                fake = by_group[id(g)] = {**g, "params": []}
                groups.append(fake)
            view = p.detach().view(-1)[start:stop]
            view.grad = grad.reshape(-1)
            fake["params"].append(view)
            state[view] = {k: self._slice(k, v, p, start, stop) for k, v in opt.state[p].items()}
        saved = opt.param_groups, opt.state
        opt.param_groups, opt.state = groups, state
        try:
            self._raw_step(opt)
        finally:
            opt.param_groups, opt.state = saved
        for view in state:
            view.grad = None
        for p, start, stop, _ in items:
            n = self._done.get(id(p), 0) + stop - start
            self._done[id(p)] = n
            if n == p.numel():
                self._finish(p)
        self.pieces += 1

    @staticmethod
    def _slice(key: str, value, p: torch.Tensor, start: int, stop: int):
        if not isinstance(value, torch.Tensor):
            return value
        if key == "step" or value.shape != p.shape:
            return value.clone()  # the step counter: advanced by _finish once the whole parameter is done
        return value.detach().view(-1)[start:stop]

    def _finish(self, p: torch.nn.Parameter) -> None:
        step = self.optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step += 1
        elif step is not None:
            self.optimizer.state[p]["step"] = step + 1
        self._stepped.append(p)

    def _step(self, *args, **kwargs):
        """The user's ``optimizer.step()``: steps what was not stepped in pieces, then resets."""
        hidden = [(p, p.grad) for p in self._stepped]
        for p, _ in hidden:
            p.grad = None  # torch optimizers skip parameters without a gradient
        try:
            return self._user_step(*args, **kwargs)
        finally:
            for p, g in hidden:
                p.grad = g
            self._stepped.clear()
            self._done.clear()
