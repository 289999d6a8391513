"""The mistakes a user who read docs/hf_models.md makes, each refused in one line that names the fix.

Found by trying the page's recipes under ``phalanx run`` with a tiny HF Llama and a DataLoader of
dict batches (the brief of s6-ux). One process each: the checks run before any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.unit


def test_a_grid_before_init_or_outside_the_launcher_says_which(alone):
    from phalanx.parallel.grid import GridError, RankGrid

    with pytest.raises(GridError, match=r"needs 4 ranks but this process runs alone; start it with "
                                        r"`phalanx run -np 4 python <script>` \(and call px.init\(\) first\)"):
        RankGrid(dp=2, tp=2)
    alone.setenv("RANK", "0")
    alone.setenv("WORLD_SIZE", "2")
    with pytest.raises(GridError, match=r"one of 2 launched ranks but torch.distributed is not initialised yet: "
                                        r"call px.init\(\) before building the grid"):
        RankGrid(tp=2)
    assert RankGrid().world_size == 1  # a grid of one is still fine alone
    with pytest.raises(GridError, match=r"dp=2 × pp=1 × tp=2 = 4, but the world size is 8"):
        RankGrid(dp=2, tp=2, world_size=8, rank=0)  # explicit sizes: the old message


def test_parallelize_refuses_zero_options_it_would_ignore_and_a_dict_batch():
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import ParallelModel, parallelize

    with pytest.raises(ValueError, match=r"zero_options=\{'state_bits': 8\}: ZeRO shards over the dp axis and this "
                                         r"mesh has dp=1, so no ZeRO runs and these options would be ignored"):
        parallelize(nn.Linear(2, 2), RankGrid(tp=2, world_size=2, rank=0), loss_fn=None, data_parallel="zero3",
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), zero_options={"state_bits": 8})
    pm = ParallelModel(nn.Linear(2, 2), None, RankGrid(world_size=1, rank=0), 1, "1f1b", (0, 1))
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(TypeError, match=r"inputs is a dict \(keys 'input_ids', 'labels'\); pass tensors: "
                                        r"pm.step\(batch\['input_ids'\], batch\['labels'\]\)"):
        pm.step(batch, batch["labels"])
    with pytest.raises(TypeError, match=r"targets is a dict"):
        pm.step(batch["input_ids"], batch)


def test_tensor_parallel_refuses_no_init_and_hf_labels(alone):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.parallel.plans import apply_tp_plan

    def llama():
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                            num_key_value_heads=2, intermediate_size=32, vocab_size=32))

    with pytest.raises(ValueError, match=r"apply_tp_plan: torch.distributed is not initialised.*call px.init\(\) "
                                         r"first \(under `phalanx run -np N`\)"):
        apply_tp_plan(llama(), group=None)
    # a fake group of 2 (torchtitan's way to unit-test a mesh in one process): the cut is real, no traffic
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = apply_tp_plan(llama(), group=None)
        assert model.lm_head.weight.shape[0] == 16  # cut by vocabulary: what HF's own loss cannot read
        ids = torch.zeros(1, 4, dtype=torch.long)
        with pytest.raises(ValueError, match=r"LlamaForCausalLM\(labels=...\) under tensor parallel: the logits are "
                                             r"cut by vocabulary.*vocab_parallel_cross_entropy\(out.logits\[:, :-1\], "
                                             r"labels\[:, 1:\], tp_group\)"):
            model(input_ids=ids, labels=ids)
    finally:
        dist.destroy_process_group()


def test_gathered_moments_into_a_tensor_parallel_slice_say_so():
    from phalanx.optim import load_named_optimizer_state, named_optimizer_state

    full = nn.Linear(2, 4, bias=False)
    opt = torch.optim.Adam(full.parameters())
    full(torch.ones(1, 2)).sum().backward()
    opt.step()
    moments = named_optimizer_state(opt, full.named_parameters())
    piece = nn.Linear(2, 2, bias=False)  # a colwise slice of the same layer
    with pytest.raises(ValueError, match=r"weight's exp_avg has shape \(4, 2\), the parameter \(2, 2\); this "
                                         r"parameter is a tensor-parallel slice: gathered moments load into an uncut"):
        load_named_optimizer_state(torch.optim.Adam(piece.parameters()), moments, piece.named_parameters())
