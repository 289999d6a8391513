"""Tensor-parallel plans for the transformers people download (Megatron-LM's cut, arXiv:1909.08053).

A plan maps module paths to styles (:mod:`phalanx.parallel.tensor`); :func:`tp_plan` writes
it from the model's own names, block by block::

    HF GPT-2        attn.c_attn   colwise_qkv   attn.c_proj  rowwise   mlp.c_fc  colwise   mlp.c_proj rowwise
    HF Llama        self_attn.{q,k,v}_proj colwise   self_attn.o_proj rowwise
    (Mistral, Qwen) mlp.{gate,up}_proj colwise       mlp.down_proj rowwise
    torchtitan      attention.[qkv_linear.]{wq,wk,wv} colwise   attention.wo rowwise
    Llama           feed_forward.{w1,w3} colwise     feed_forward.w2 rowwise
    all             input embedding vocab, head (lm_head / output) colwise: logits stay cut by
                    vocabulary, so the loss is ``vocab_parallel_cross_entropy``

:func:`apply_tp_plan` applies it and then tells the attention code its local head count
where it needs one (HF GPT-2 splits its fused q/k/v at ``split_size``; Llama's and
torchtitan's attention infer heads from ``view(…, -1, head_dim)``), and re-ties a head that
*is* the embedding (both are cut by vocabulary rows, so the local slices tie too).

Example::

    from phalanx.parallel.plans import apply_tp_plan
    from phalanx.parallel.tensor import vocab_parallel_cross_entropy
    model = apply_tp_plan(LlamaForCausalLM(cfg), group=tp_group)
    loss = vocab_parallel_cross_entropy(model(input_ids=x).logits, y, tp_group)
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from phalanx.parallel.pipeline.by_path import find_blocks
from phalanx.parallel.tensor import apply_tensor_parallel

__all__ = ["tp_plan", "apply_tp_plan", "BLOCK_STYLES"]

# Each family's block, by the names of its projections (suffix inside a block → style).
BLOCK_STYLES: dict[str, dict[str, str]] = {
    "hf-gpt2": {"attn.c_attn": "colwise_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                "mlp.c_proj": "rowwise"},
    "hf-llama": {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"},
    # torchtitan 0.3 (q/k/v under attention.qkv_linear when not fused)
    "torchtitan-llama": {"attention.qkv_linear.wq": "colwise", "attention.qkv_linear.wk": "colwise",
                         "attention.qkv_linear.wv": "colwise", "attention.wo": "rowwise",
                         "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"},
    # torchtitan before 0.3
    "torchtitan-llama-0.2": {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                             "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
                             "feed_forward.w2": "rowwise"},
}
HEADS = ("lm_head", "output")  # HF, torchtitan


def _embedding_and_head(model: nn.Module) -> tuple[str, str]:
    names = {id(m): n for n, m in model.named_modules()}
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_name = names.get(id(emb)) if emb is not None else next(
        (n for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)
    head_name = next((n for n in HEADS if isinstance(getattr(model, n, None), nn.Linear)), None)
    if emb_name is None or head_name is None:
        raise ValueError(f"tp_plan: {type(model).__name__} has no input embedding or no head named "
                         f"{' / '.join(HEADS)}; pass a plan of your own to apply_tensor_parallel")
    return emb_name, head_name


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Megatron's plan for an HF GPT-2 / Llama-family causal LM or a torchtitan Llama, from its module names."""
    _, blocks = find_blocks(model)
    block = model.get_submodule(blocks[0])
    inner = {n for n, _ in block.named_modules()}
    family = next((f for f, styles in BLOCK_STYLES.items() if set(styles) <= inner), None)
    if family is None:
        raise ValueError(f"tp_plan: no plan for blocks of type {type(block).__name__} (known: "
                         f"{', '.join(BLOCK_STYLES)}); pass a plan of your own to apply_tensor_parallel")
    emb, head = _embedding_and_head(model)
    plan = {emb: "vocab", head: "colwise"}
    for b in blocks:
        plan.update({f"{b}.{suffix}": style for suffix, style in BLOCK_STYLES[family].items()})
    return plan


def _check_heads(model: nn.Module, tp: int) -> None:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)  # HF
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None:  # torchtitan: the attention modules hold them
        attn = next((m for m in model.modules() if isinstance(getattr(m, "n_kv_heads", None), int)), None)
        heads, kv = (attn.n_heads, attn.n_kv_heads) if attn is not None else (None, None)
    if heads is not None and (heads % tp or kv % tp):
        raise ValueError(f"tensor parallel {tp}: {heads} attention heads and {kv} key/value heads must both "
                         f"divide by it; pick a tp dividing {kv}")


def apply_tp_plan(model: nn.Module, group, plan: dict[str, str] | None = None) -> nn.Module:
    """:func:`tp_plan` (or ``plan``) applied in place, local head counts set, a tied head re-tied."""
    if not dist.is_initialized():
        raise ValueError("apply_tp_plan: torch.distributed is not initialised, so there is no tensor-parallel "
                         "group to cut over; call px.init() first (under `phalanx run -np N`)")
    tp = dist.get_world_size(group)
    _check_heads(model, tp)
    plan = tp_plan(model) if plan is None else plan
    emb, head = _embedding_and_head(model)
    tied = model.get_submodule(emb).weight is model.get_submodule(head).weight
    apply_tensor_parallel(model, plan, group)
    for m in model.modules():
        # HF GPT-2's attention splits its fused [q | k | v] output at split_size (= embed_dim)
        if type(m).__name__.startswith("GPT2Attention") and hasattr(m, "split_size"):
            m.split_size //= tp
            m.embed_dim //= tp
            m.num_heads //= tp
    if tied:
        model.get_submodule(head).weight = model.get_submodule(emb).weight  # same vocabulary rows on this rank
    if tp > 1 and hasattr(model, "config"):  # HF: its labels= loss would read this rank's vocabulary slice
        model.register_forward_pre_hook(_refuse_labels, with_kwargs=True)
    return model


def _refuse_labels(module: nn.Module, args, kwargs):
    if kwargs.get("labels") is not None:
        raise ValueError(f"{type(module).__name__}(labels=...) under tensor parallel: the logits are cut by "
                         "vocabulary, which the model's own loss cannot read; call it without labels and take "
                         "vocab_parallel_cross_entropy(out.logits[:, :-1], labels[:, 1:], tp_group) (HF's shift, done by hand)")
