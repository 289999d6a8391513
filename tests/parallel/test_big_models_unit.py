"""Big-model pieces checked in one process (no ranks): the one-line refusals of 8-bit state, of
the pipeline cut by module path and of the tensor-parallel plans; 8-bit quantization and its step
bound; per-block recomputation's saved bytes; optimizer state keyed by name, loaded into a subset
of the parameters and into 8-bit state. The checks with real ranks are in test_big_models.py.
"""

import pytest
import torch
from hf_models import batch, hf_model, lm_loss

import phalanx as px
from phalanx.optim import Adam8bit, load_named_optimizer_state, named_optimizer_state
from phalanx.parallel.pipeline import partition, split_by_path
from phalanx.parallel.plans import tp_plan
from phalanx.parallel.zero import zero

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

@pytest.mark.unit
def test_state_bits_mistakes_are_one_line():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"zero\(state_bits=4\): use 32"):
        zero(lin, torch.optim.Adam(lin.parameters()), stage=3, state_bits=4)
    with pytest.raises(ValueError, match=r"state_bits=8\) quantizes Adam's moments; got SGD"):
        zero(lin, torch.optim.SGD(lin.parameters(), lr=0.1), stage=2, state_bits=8)
    with pytest.raises(ValueError, match=r"DistributedOptimizer\(state_bits=8\) quantizes"):
        px.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), state_bits=8)



@pytest.mark.unit
def test_pipeline_and_plan_mistakes_are_one_line():
    gpt2 = hf_model("gpt2", layers=2)
    with pytest.raises(ValueError, match=r"boundaries \['transformer.h.7'\]: each must name a block"):
        split_by_path(gpt2, ["transformer.h.7"], 0)
    last = split_by_path(hf_model("gpt2", layers=2), ["transformer.h.1"], 1)  # tied: a copy on stages 0 and 1
    assert [(t.name, t.stages) for t in last.tied_across_stages] == [("transformer.wte.weight", (0, 1))]
    assert last.tied_across_stages[0].param is last.model.lm_head.weight
    with pytest.raises(ValueError, match=r"^zero\(stage=2\): parameter transformer.wte.weight is tied across "
                                         r"pipeline stages 0, 1, .*tie_word_embeddings=False"):
        zero(last, torch.optim.Adam(last.parameters()), stage=2)
    with pytest.raises(ValueError, match="use 'uniform' or 'parameters'"):
        partition(gpt2, 2, method="time", sample=batch(0)[0])
    with pytest.raises(ValueError, match="no plan for blocks of type Linear"):
        tp_plan(torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)] * 2)))
    with pytest.raises(TypeError, match="has no nn.ModuleList"):
        split_by_path(torch.nn.Linear(2, 2), [], 0)


@pytest.mark.unit
def test_quantize_table_picks_the_nearest_code():
    """The fp16 lookup table agrees with an exact nearest-code search but for values within half
    an fp16 step of a midpoint (one code apart), and round-trips Adam-like moments closely."""
    from phalanx.optim.quantize import BLOCK, CODE_SIGNED, CODE_UNSIGNED, dequantize, quantize

    torch.manual_seed(0)
    for code, x in ((CODE_SIGNED, torch.randn(1 << 16) * 1e-3), (CODE_UNSIGNED, torch.randn(1 << 16).pow(2) * 1e-6)):
        q, absmax = quantize(x, code)
        blocks = x.view(-1, BLOCK)
        exact = torch.bucketize((blocks / blocks.abs().amax(1, keepdim=True)).reshape(-1), (code[1:] + code[:-1]) / 2)
        assert (q.long() == exact).float().mean() > 0.99 and (q.long() - exact).abs().max() <= 1
        back = dequantize(q, absmax, code, x.numel())
        assert (back - x).norm() / x.norm() < 0.02


@pytest.mark.unit
def test_eight_bit_step_moves_no_element_further_than_adam_can():
    """A block whose second moment underflows to code 0 for its small elements (one large element sets
    the block's scale, as in ZeRO's flat shards) while their first moments survive: without the bound
    on m/sqrt(v) a zero gradient then moves them by ~lr·m/eps. Exact Adam moves none by more than ~lr."""
    p = torch.nn.Parameter(torch.zeros(2048))
    opt = Adam8bit([p], lr=1e-2)
    for g in (torch.full((2048,), 1e-6), torch.zeros(2048)):
        g[0] = 1.0
        p.grad = g
        opt.step()
    assert p.abs().max().item() <= 2 * 1e-2 * 1.001, p.abs().max().item()


def _saved_bytes(recompute: bool, layers: int) -> int:
    """Bytes autograd keeps from one forward (parameters excluded), each storage counted once."""
    m = hf_model("llama", layers=layers)
    if recompute:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(m, *batch(0, rows=4))
    return sum(kept.values())


@pytest.mark.unit
def test_recomputation_keeps_one_input_per_block():
    """Per-block recomputation (Chen et al. 2016, arXiv:1604.06174): a block keeps only its input,
    B·T·D fp32 values, where without it keeps every intermediate of its forward."""
    per_block = {rc: (_saved_bytes(rc, 4) - _saved_bytes(rc, 2)) / 2 for rc in (False, True)}
    rows, seq, width = 4, 8, 32
    assert per_block[True] == rows * seq * width * 4, per_block
    assert per_block[False] > 10 * per_block[True], per_block


@pytest.mark.unit
def test_parallelize_refuses_what_a_cut_by_module_path_cannot_do_in_one_line():
    from phalanx.parallel.grid import RankGrid
    from phalanx.parallel.parallelize import parallelize

    llama = hf_model("llama", tie=False, layers=4)
    with pytest.raises(ValueError, match=r"schedule='interleaved_1f1b' keeps several chunks per stage, which "
                                         r"needs an nn.Sequential; LlamaForCausalLM is cut by module path"):
        parallelize(llama, RankGrid(pp=2, world_size=2, rank=0), loss_fn=None, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"ep=2 on LlamaForCausalLM \(not an nn.Sequential\) is not supported"):
        parallelize(llama, RankGrid(ep=2, world_size=2, rank=0), loss_fn=None)
    with pytest.raises(ValueError, match=r"zero_options=\{'state_bits': 8\} are for ZeRO: pass data_parallel="):
        parallelize(llama, RankGrid(dp=2, world_size=2, rank=0), loss_fn=None, zero_options={"state_bits": 8})
    with pytest.raises(TypeError, match="tp_plan= must be a dict of module path -> style, got list"):
        parallelize(llama, RankGrid(tp=2, world_size=2, rank=0), loss_fn=None, tp_plan=["q_proj"])


@pytest.mark.unit
def test_recompute_blocks_keeps_names_and_recomputes_once_per_block():
    """Wrapped twice is wrapped once; the state dict's keys do not change; backward runs each block again."""
    from phalanx.parallel.pipeline import recompute_blocks

    m = hf_model("llama", layers=2)
    keys = list(m.state_dict())
    calls = []
    m.model.layers[0].input_layernorm.register_forward_pre_hook(lambda mod, args: calls.append(1))
    recompute_blocks(recompute_blocks(m))
    assert list(m.state_dict()) == keys
    lm_loss(m, *batch(0)).backward()
    assert len(calls) == 2, calls


@pytest.mark.unit
def test_gather_tp_state_dict_of_a_freed_parameter_is_one_line():
    """A module inside a ZeRO-3 root holds freed parameters (gloo's all_gather of them crashed the rank)."""
    from phalanx.parallel.tensor import gather_tp_state_dict

    lin = torch.nn.Linear(4, 4)
    lin.weight.data.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="weight has no storage here .* pass the module px.zero wrapped"):
        gather_tp_state_dict(lin, None)


@pytest.mark.unit
def test_named_optimizer_state_loads_into_a_subset_and_into_8_bit():
    """Adam's state by parameter name: a second model loading it takes the same next step; an optimizer
    over part of the model (a stage) takes its part; Adam8bit requantizes it; a wrong shape is one line."""
    import copy

    m = hf_model("llama")
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        opt.zero_grad()
        lm_loss(m, *batch(s)).backward()
        opt.step()
    state = named_optimizer_state(opt, m.named_parameters())
    assert set(state["state"]) == {n for n, _ in m.named_parameters()} and state["param_groups"][0]["lr"] == 1e-2
    twin = copy.deepcopy(m)
    part = list(twin.model.layers[0].named_parameters(prefix="model.layers.0"))
    opts = {"whole": torch.optim.Adam(twin.parameters(), lr=5e-2),  # the saved lr wins
            "part": torch.optim.Adam([p for _, p in part], lr=1e-2), "8bit": Adam8bit(twin.parameters(), lr=1e-2)}
    load_named_optimizer_state(opts["whole"], state, twin.named_parameters())
    load_named_optimizer_state(opts["part"], state, part)
    load_named_optimizer_state(opts["8bit"], state, twin.named_parameters())
    for o in opts.values():
        assert all(o.state[p] for g in o.param_groups for p in g["params"])
    name, p = part[0]
    assert torch.equal(opts["part"].state[p]["exp_avg"], state["state"][name]["exp_avg"])
    assert (opts["8bit"].full_precision_state(p)["exp_avg"] - state["state"][name]["exp_avg"]).abs().max() < 1e-2 * (
        state["state"][name]["exp_avg"].abs().max())
    saved = state["state"][name]["exp_avg"].clone()
    for o in (opt, opts["whole"]):
        model = m if o is opt else twin
        o.zero_grad()
        lm_loss(model, *batch(2)).backward()
        o.step()
    assert max((a - b).abs().max().item() for a, b in zip(m.parameters(), twin.parameters())) == 0.0
    assert torch.equal(state["state"][name]["exp_avg"], saved), "the load copies: stepping must not change the dict"
    state["state"][name]["exp_avg"] = state["state"][name]["exp_avg"][:1]
    with pytest.raises(ValueError, match=rf"{name}'s exp_avg has shape .* gather the tensor-parallel slices first"):
        load_named_optimizer_state(torch.optim.Adam([p for _, p in part]), state, part)


@pytest.mark.unit
def test_a_tied_copy_gets_a_zero_unit_and_optimizer_views_of_its_own():
    """ZeRO on a pipeline stage: a copy tied across stages is a unit alone (the same shard layout on every
    stage) and its slice of the shard starts and ends views of the inner optimizer (8-bit blocks line up)."""
    from phalanx.parallel.zero.shard import CHUNK_NUMEL, assign_shard_offsets, build_units, chunks

    a, tied, b = (torch.nn.Parameter(torch.zeros(n)) for n in (5, 8, 3))
    named = [("a", a), ("tied", tied), ("b", b)]
    units = build_units(named, world=2, bucket_numel=1 << 20, alone={id(tied)})
    assert [u.names for u in units] == [["a", "b"], ["tied"]]
    assert [u.names for u in build_units(named, 2, None, {id(tied)})] == [["a", "b"], ["tied"]]  # stage 3
    assert assign_shard_offsets(units) == 4 + 4 and units[1].shard_offset == 4
    flat = torch.arange(float(CHUNK_NUMEL + 10))
    views = chunks(flat, [4, 8])
    assert [v.numel() for v in views] == [4, 4, CHUNK_NUMEL, 2] and views[1][0] == 4
    assert [v.numel() for v in chunks(flat)] == [CHUNK_NUMEL, 10]


@pytest.mark.unit
def test_clip_grad_norm_on_one_piece_is_torchs_and_refuses_a_bad_max_norm():
    """With no split axis the whole model's norm is torch's (the grid checks it over pp and tp)."""
    from phalanx.parallel import clip_grad_norm_

    torch.manual_seed(0)  # (not whatever the tests before left)
    ours, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    for m in (ours, ref):
        m(torch.ones(2, 4)).pow(2).sum().backward()
    norm = clip_grad_norm_(ours, 0.1)  # below the norm: clipping active
    assert norm.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()) and norm > 0.1
    for p, q in zip(ours.parameters(), ref.parameters()):
        # equal to rounding: torch takes the norm of the per-tensor norms, phalanx the root of the summed
        # squares (what pieces on several ranks add up), which can differ in the last bit (seen with some seeds)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"^clip_grad_norm_\(max_norm=0\): must be a positive number$"):
        clip_grad_norm_(ours, 0)
