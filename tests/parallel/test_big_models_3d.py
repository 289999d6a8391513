"""ZeRO x tensor x pipeline parallel at once: ``parallelize()`` over a dp 2 x pp 2 x tp 2 grid of 8 real
ranks on HF Llama (ZeRO-3, every block recomputed), HF GPT-2 (its head tied across the stages, ZeRO-1) and torchtitan's Llama
(ZeRO-2), each against one process of the same model: the loss of every step and this rank's
parameters (its stage, gathered over its tp pair). HF Llama's parameters and Adam's moments (ZeRO's
consolidated over dp, gathered over tp, both stages') then continue at world 1: the next two losses.

One spawned group of 8 ranks runs every check (tiny models: 8 ranks share 2 cores); each check is its
own test below.
"""

import pytest
from hf_models import PARAM_TOL, have, parallelize_cell

from phalanx.testing import distributed

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

pytestmark = pytest.mark.ranks

STEPS = 3
CELLS = {"llama zero3": ("llama", "zero3", True, False), "gpt2 zero1": ("gpt2", "zero1", False, True),
         "titan zero2": ("titan", "zero2", False, False)}
"""name: (model, data_parallel, recomputed, tied: GPT-2's head a copy on each stage, summed by ZeRO)"""


def _all_checks():
    import time

    out, t0 = {}, time.perf_counter()
    for name, (kind, dp, rc, tie) in CELLS.items():
        if have(kind):
            out[name] = parallelize_cell(kind, tie, 4, dp=2, pp=2, tp=2, data_parallel=dp, checkpoint=rc, steps=STEPS,
                                         move_to_world1=name == "llama zero3")
            out[name]["seconds"], t0 = time.perf_counter() - t0, time.perf_counter()
    return out


@pytest.fixture(scope="module")
def grid3d():
    """One spawned group of 8 ranks runs every check; each check below is its own test."""
    return distributed(_all_checks, np=8, timeout=400)


@pytest.mark.parametrize("name", [n if n != "titan zero2" else pytest.param(n, marks=pytest.mark.skipif(
    not have("titan"), reason="torchtitan is not installed (pip install torchtitan)")) for n in CELLS])
def test_zero_tensor_and_pipeline_parallel_at_once_match_one_process(name, grid3d):
    recomputed = CELLS[name][2]
    coords = sorted(res[name]["coord"] for res in grid3d)
    assert coords == [(d, s, t) for d in (0, 1) for s in (0, 1) for t in (0, 1)], coords  # every cell of the grid
    for res in grid3d:
        r = res[name]
        assert r["tied"] == CELLS[name][3], r
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), r
        assert r["keys"] > 0 and r["diff"] < PARAM_TOL, (r["worst"], r)
        # block 0 (stage 0): 2 micro-batches a step, each run twice when recomputed
        assert r["block_forwards"] == (STEPS * 2 * (2 if recomputed else 1) if r["coord"][1] == 0 else 0), r
        if name == "llama zero3":  # parameters and Adam's moments of all 8 ranks, at world 1: the next two losses
            assert r["world1"] == pytest.approx(r["continued"], rel=1e-5), r
            assert abs(r["world1 fresh adam"][1] - r["continued"][1]) > 1e-3 * r["continued"][1], r
