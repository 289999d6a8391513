"""Tiny Hugging Face / torchtitan transformers for the tests, built from configs with random weights."""

import importlib.util

import torch
import torch.nn.functional as F

VOCAB, SEQ = 64, 8
STEPS = 5
# GPT-2's attention has a key bias, whose gradient is zero (softmax ignores a shift along the keys):
# Adam divides that rounding noise by its own tiny second moment, so it drifts ~1e-4 between any
# two summation orders. It is compared loosely, every other tensor tightly.
KEY_BIAS = "c_attn.bias"


PARAM_TOL = 2.5e-4
"""Parameter tolerance after 3 Adam steps at lr 1e-2 against one process: 2.5% of one step. Rounding moves
the elements of near-zero gradient, whose Adam step follows the gradient's sign: torchtitan's
layers.1.attention.wo by 1.4e-5 when one process sums 2 micro-batches instead of the batch, and by 7.5e-5
to 8.1e-5 under micro-batches, tp's partial sums and ZeRO's reduce-scatter. How far depends on the CPU's
kernels: on an AVX-512 machine tp's partial sums moved GPT-2's and torchtitan's such elements 6.3e-5 to
1.2e-4, where the same tests under ATEN_CPU_CAPABILITY=avx2 stayed under 5e-5 (2026-11-27). A missing
reduction moves elements by ~lr (1e-2), 40x this."""


def hf_model(kind: str, tie: bool = True, layers: int = 2):
    """``"gpt2"`` or ``"llama"`` (grouped-query attention: 4 heads, 2 key/value heads), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ * 2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                         tie_word_embeddings=tie)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, tie_word_embeddings=tie,
                      max_position_embeddings=SEQ * 2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


class _Anything:
    """Stands for any attribute of the triton stub: callable, indexable, and a decorator that keeps the function."""

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name):
        return self

    def __getitem__(self, key):
        return self


def _stub_attribute(name: str):
    if name.startswith("__"):  # __file__, __path__, ...: a plain module's answer (inspect walks sys.modules)
        raise AttributeError(name)
    return _Anything()


def _import_titan():
    """``torchtitan.models.llama3``. torchtitan 0.3 imports triton at module level for its expert-parallel
    kernels (``torchtitan.distributed.minimal_async_ep.kernels``: ``@triton.jit`` functions and ``tl.*``
    annotations), which a dense Llama never calls; its pip metadata does not pull triton in, and
    triton's LLVM clashes with TensorFlow's in one process. Where triton is absent a stub stands in
    for the import only, and is taken out of ``sys.modules`` again so that nothing after it (torch's
    own ``has_triton`` checks) sees a triton. It goes in only after a first import without it has
    failed on triton: by then torch's modules that probe for triton have loaded, and found none."""
    import sys
    import types

    try:  # first without: whatever imports cleanly (torch's own modules, which probe for triton) stays loaded
        import torchtitan.models.llama3 as titan

        return titan
    except ModuleNotFoundError as e:
        if e.name != "triton" or "triton" in sys.modules:
            raise
    stubs = {}
    for name in ("triton", "triton.language"):
        mod = types.ModuleType(name)
        mod.__getattr__ = _stub_attribute
        stubs[name] = sys.modules[name] = mod
    stubs["triton"].language = stubs["triton.language"]
    try:
        import torchtitan.models.llama3 as titan
    finally:
        for name, mod in stubs.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
    return titan


def titan_model(layers: int = 2):
    """torchtitan's Llama 3 (4 heads, 2 key/value heads), with torchtitan's SDPA attention module in place of
    its default flex attention: torchtitan 0.3 refuses ``attn_backend="sdpa"`` for language models, and
    torch's FlexAttention "does not support backward on CPU"."""
    titan = _import_titan()
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE

    torch.manual_seed(0)
    dim = 32
    blocks = titan._build_llama3_layers(n_layers=layers, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                        rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=SEQ * 2, theta=10000.0),
                                        attn_backend="flex", fuse_qkv=False)
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = titan.Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=blocks,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=titan._output_linear_init(dim)))
    return cfg.build()


def make(kind: str, tie: bool = True, layers: int = 2):
    """``"gpt2"``, ``"llama"`` (HF) or ``"titan"`` (torchtitan's Llama 3, never tied)."""
    return titan_model(layers) if kind == "titan" else hf_model(kind, tie, layers)


def batch(step: int, rows: int = 4):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def logits(model, x):
    titan = type(getattr(model, "module", model)).__name__ == "Llama3Model"  # DataParallel holds it in .module
    out = model(x) if titan else model(input_ids=x)
    return out.logits if hasattr(out, "logits") else out


def lm_loss(model, x, y):
    return F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten())


def max_diff(sd: dict, ref: dict, skip: str = "") -> float:
    """Largest element difference over the keys of ``ref`` (``skip``: a substring of keys left out)."""
    return max((sd[k].float() - ref[k].float()).abs().max().item() for k in ref if not (skip and skip in k))


def have(kind: str) -> bool:
    """transformers / torchtitan installed (found, not imported: torchtitan is imported in the ranks,
    through :func:`_import_titan`, which stands a stub in for triton where it is absent)."""
    return importlib.util.find_spec("torchtitan" if kind == "titan" else "transformers") is not None


def recompute(model, kind: str):
    """Every block recomputed in backward: HF's own switch, torchtitan through phalanx's ``recompute_blocks``."""
    if kind == "titan":
        from phalanx.parallel.pipeline import recompute_blocks

        return recompute_blocks(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


FIRST_NORM = {"gpt2": "transformer.h.0.ln_1", "llama": "model.layers.0.input_layernorm", "titan": "layers.0.attention_norm"}


def count_block_forwards(model, kind: str) -> list:
    """A list that grows by one each time block 0 runs its forward (twice a step when recomputed)."""
    calls = []
    model.get_submodule(FIRST_NORM[kind]).register_forward_pre_hook(lambda mod, args: calls.append(1))
    return calls


def my_rows(t):
    import phalanx as px

    return t.chunk(px.size())[px.rank()]


def train(model, opt, steps, rows=4, sharded=True, clip=None, norms=None):
    """One Adam step per batch in ``steps``; ``sharded``: this rank's rows of it. The local losses.
    ``clip``: ``torch.nn.utils.clip_grad_norm_`` at that max norm before each step, its norms appended to ``norms``."""
    losses = []
    for s in steps:
        x, y = batch(s, rows)
        if sharded:
            x, y = my_rows(x), my_rows(y)
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(loss.detach())
    return losses


def global_mean(losses, group=None):
    """The mean over ranks of each step's loss (the full batch's loss: equal parts)."""
    import torch.distributed as dist

    t = torch.stack(losses)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def conv_keys(model):
    """HF GPT-2's Conv1D weights ([in, out]; tensor parallel stores them as linear layers, [out, in])."""
    return {f"{n}.weight" for n, mod in model.named_modules() if type(mod).__name__ == "Conv1D"}


def parallelize_cell(kind, tie, layers, dp, pp, tp, data_parallel, checkpoint, steps=3, move_to_world1=False,
                     zero_options=None, clip=None, reload_sharded=False):
    """parallelize() on the model in one call over dp x pp x tp, against one process (full batch, Adam
    at lr 1e-2): each step's loss and the parameters (gathered over tp; under pp this stage's).
    ``move_to_world1``: then the parameters and Adam's moments of every stage (gathered over tp, ZeRO's
    consolidated over dp) load into the plain model at world 1, whose next two losses ("world1") must
    equal the parallel run's ("continued"): the first checks the parameters, the second the moments.
    A head tied across pipeline stages: "copies" is the largest difference between its stages' copies.
    ``clip``: both sides clip by that max norm before each step (one process: torch's ``clip_grad_norm_``;
    the grid: ZeRO's ``max_grad_norm`` or ``pm.clip_grad_norm_``); their norms are "norms" and "ref norms".
    ``reload_sharded`` (ZeRO, with ``move_to_world1``): every dp rank's ``sharded_state_dict`` of this stage,
    loaded into a fresh ``parallelize`` of the same layout, whose next two losses are "reloaded"."""
    import torch.distributed as dist

    from phalanx.optim import load_named_optimizer_state
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import parallelize
    from phalanx.parallel.tensor import (
        gather_tp_optimizer_state,
        gather_tp_state_dict,
        vocab_parallel_cross_entropy,
    )

    ref = make(kind, tie=tie, layers=layers)
    ref_norms, norms, refused = [], [], []
    ref_losses = [float(v) for v in train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), range(steps),
                                          sharded=False, clip=clip, norms=ref_norms)]
    if clip is not None and data_parallel.startswith("zero"):
        zero_options = {**(zero_options or {}), "max_grad_norm": clip}
    mesh = RankGrid(dp=dp, pp=pp, tp=tp)
    d = mesh.coord[0]

    def loss_fn(out, y):
        return vocab_parallel_cross_entropy(out, y, mesh.tp_group)

    pm = parallelize(make(kind, tie=tie, layers=layers), mesh, loss_fn=loss_fn, num_microbatches=2,
                     data_parallel=data_parallel, checkpoint=checkpoint,
                     optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), zero_options=zero_options)
    calls = count_block_forwards(pm.module.model, kind) if mesh.coord[1] == 0 else []

    def run(steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            pm.optimizer.zero_grad()
            losses.append(pm.step(x.chunk(dp)[d], y.chunk(dp)[d]).item())
            if clip is not None and not data_parallel.startswith("zero"):
                norms.append(pm.clip_grad_norm_(clip).item())
            if clip is not None and data_parallel.startswith("zero"):
                try:  # refused: ZeRO holds the gradients and clips them itself
                    pm.clip_grad_norm_(clip)
                except ValueError as e:
                    refused.append(str(e))
            norm = pm.optimizer.step()
            if clip is not None and data_parallel.startswith("zero"):
                norms.append(norm.item())
        return losses

    losses = run(range(steps))
    model = pm.module.model
    # on the stage module, ZeRO-3's root: it gathers its shards for state_dict() there
    conv = conv_keys(ref) if tp > 1 else set()  # the plan's layers are linear; without tp they stay Conv1D

    def plain(v, k):  # this stage's tensor under the plain model's name and layout
        k = k.removeprefix("model.")
        return k, (v.t() if k in conv and isinstance(v, torch.Tensor) and v.dim() == 2 else v)

    full, rsd = dict(plain(v, k) for k, v in gather_tp_state_dict(pm.module, mesh.tp_group).items()), ref.state_dict()
    own = [k for k, _ in model.named_parameters()]  # other stages' modules hold none
    copies = 0.0
    if pp > 1:  # the head on the last stage, the embedding on the first: a copy on each
        tied = any(t.param is not None for t in pm.module.tied_across_stages)
        name_of = {id(p): n.removeprefix("model.") for n, p in pm.module.named_parameters()}
        mine = [full[name_of[id(t.param)]] if t.param is not None else None for t in pm.module.tied_across_stages]
        every = [None] * pp
        dist.all_gather_object(every, mine, group=mesh.pp_group)
        for held in zip(*every):
            held = [c for c in held if c is not None]
            copies = max([copies] + [(c - held[0]).abs().max().item() for c in held[1:]])
        # the groups this stage sums and sends copies over: {holders: their global ranks}
        zero_tied = getattr(pm.optimizer, "tied", None) if data_parallel.startswith("zero") else None
        holders = zero_tied.groups if zero_tied is not None else pm.stage.tied_groups
    else:
        tied = model.lm_head.weight is model.get_input_embeddings().weight if tie else False
        holders = {}
    diffs = {k: max_diff(full, {k: rsd[k]}) for k in own}
    out = {"losses": losses, "ref": ref_losses, "diff": max_diff(full, {k: rsd[k] for k in own}, KEY_BIAS),
           "block_forwards": len(calls), "keys": len(own), "coord": mesh.coord, "tied": tied,
           "worst": max(diffs, key=diffs.get), "copies": copies, "norms": norms, "ref norms": ref_norms,
           "refused": refused, "tied groups": {s: sorted(dist.get_process_group_ranks(g)) for s, g in holders.items()}}
    if pp > 1 and data_parallel.startswith("zero"):  # a tied copy's state: on its first holder only
        state = [v for st in pm.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        held = [t for t in pm.module.tied_across_stages if t.param is not None]
        out.update({"state elements": sum(v.numel() for v in state if v.dtype == torch.float32),
                    "stepped elements": sum(c.numel() for g in pm.optimizer.param_groups for c in g["params"]),
                    "state entries": (len(pm.optimizer.state), sum(len(g["params"]) for g in pm.optimizer.param_groups)),
                    "shard elements": sum(c.numel() for cs in pm.optimizer.chunks for c in cs),
                    "copy elements": {t.stages[0] == mesh.coord[1]: -(-t.param.numel() // dp) for t in held}})
    if move_to_world1:
        moments = gather_tp_optimizer_state(pm.module, pm.optimizer, mesh.tp_group)
        mine = {"params": full, "state": dict(plain({s: plain(v, k)[1] for s, v in st.items()}, k)
                                                 for k, st in moments["state"].items())}
        stages = [None] * pp
        dist.all_gather_object(stages, mine, group=mesh.pp_group)
        shards = [None] * dp
        if reload_sharded:
            dist.all_gather_object(shards, pm.optimizer.sharded_state_dict(), group=mesh.dp_group)
        out["continued"] = run(range(steps, steps + 2))
        if reload_sharded:
            pm = parallelize(make(kind, tie=tie, layers=layers), mesh, loss_fn=loss_fn, num_microbatches=2,
                             data_parallel=data_parallel, checkpoint=checkpoint,
                             optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), zero_options=zero_options)
            pm.optimizer.load_sharded_state_dict(shards)
            out["reloaded"] = run(range(steps, steps + 2))
        for key in ("world1", "world1 fresh adam"):  # the control: a fresh Adam's second step is another
            world1 = make(kind, tie=tie, layers=layers)
            world1.load_state_dict({k: v for st in stages for k, v in st["params"].items()}, strict=False)
            opt1 = torch.optim.Adam(world1.parameters(), lr=1e-2)
            if key == "world1":
                groups = [{**g, "params": [n for st in stages for n in st["params"]]} for g in moments["param_groups"][:1]]
                load_named_optimizer_state(opt1, {"state": {k: v for st in stages for k, v in st["state"].items()},
                                                  "param_groups": groups}, world1.named_parameters())
            out[key] = [float(v) for v in train(world1, opt1, range(steps, steps + 2), sharded=False)]
    return out
