"""Checkpoint files any tool reads: real tensor names, replicated state once, old checkpoints, manifest validation,
export (function and CLI)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import phalanx as px
import phalanx.checkpoint as ckpt
from phalanx.checkpoint import io, plan
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

st = pytest.importorskip("safetensors.torch", reason="safetensors not installed: cannot cross-check the format")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))


def _trained():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)  # the same batches on every rank: replicated, as DP keeps it
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))


def _save_replicated(root):
    r, n = px.rank(), px.size()
    model, opt = _trained()
    mine = torch.full((3,), float(r))  # same name, different bytes per rank: must not be merged
    # the same, large enough to be merged by description and checked only after the write
    big = torch.full((BIG,), float(r))
    shard = ckpt.Shard(torch.arange(4.0) + 4 * r, global_shape=(4 * n,), offsets=(4 * r,))
    ckpt.save(root, {"model": model, "optim": opt, "mine": mine, "big": big, "same": torch.full((BIG,), 7.0),
                     "shard": shard,
                     "rng": ckpt.RNGState(), "step": 7})
    return {k: v.clone() for k, v in model.state_dict().items()}


BIG = plan.EAGER_DIGEST_BYTES // 4 + 1  # float32 elements: just over the bound of the digest before the plan


def _load_other_world(root):
    r, n = (px.rank(), px.size()) if px.is_initialized() else (0, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    lo, hi = 8 * r // n, 8 * (r + 1) // n
    state = {"model": model, "optim": opt, "mine": torch.zeros(3), "big": torch.zeros(BIG), "step": 0,
             "shard": ckpt.Shard(torch.zeros(hi - lo), global_shape=(8,), offsets=(lo,))}
    ckpt.load(root, state)
    assert torch.equal(state["big"], torch.full((BIG,), float(r if r < 2 else 0))), "big: not this rank's own"
    return ({k: v.clone() for k, v in model.state_dict().items()}, state["mine"].clone(), state["shard"].tensor.clone(),
            (lo, hi), state["step"], len(opt.state_dict()["state"]))


def _load_reports(root):
    try:
        _load_other_world(root)
    except ckpt.CorruptCheckpointError as err:
        return str(err)
    return "ok"


def test_replicated_state_is_written_once_under_real_names_and_loads_anywhere(tmp_path):
    root = str(tmp_path / "ck")
    saved = distributed(_save_replicated, np=2, args=(root,))
    want = saved[0]
    files = sorted(os.listdir(root))
    manifest = json.loads(open(os.path.join(root, ckpt.MANIFEST)).read())
    # the model and the optimizer (equal on both ranks) each in one file, written by one rank
    assert "model.safetensors" in files and any(f.startswith("optim.part") for f in files), files
    model_file = os.path.join(root, "model.safetensors")
    assert os.path.getsize(model_file) < _nbytes(want) + 4096  # one copy on disk (plus its JSON header)
    for r in range(2):
        recs = manifest["ranks"][r]["tensors"].values()
        assert {rec["file"] for rec in recs if rec["path"].startswith("model/")} == {"model.safetensors"}
        assert {rec["file"] for rec in recs if rec["path"] == "mine"} == {f"rank{r:05d}.safetensors"}
    # "big" was written once by one rank; the other found its copy differs after the write and kept its own
    big_files = [manifest["ranks"][r]["tensors"][t]["file"] for r in range(2)
                 for t, rec in manifest["ranks"][r]["tensors"].items() if rec["path"] == "big"]
    assert len(set(big_files)) == 2 and any(f.endswith(".diverged.safetensors") for f in big_files), big_files
    same_files = {manifest["ranks"][r]["tensors"][t]["file"] for r in range(2)
                  for t, rec in manifest["ranks"][r]["tensors"].items() if rec["path"] == "same"}
    assert same_files == {"same.safetensors"}, same_files  # large and equal: merged, checked, written once
    tensor_bytes = sum(os.path.getsize(os.path.join(root, f)) for f in files if not f.endswith(".json"))
    tensor_bytes -= 3 * 4 * BIG  # the two copies of "big" (they differ: both belong on disk), "same" once
    opt_bytes = 2 * _nbytes(want)  # Adam: two moments per parameter (BatchNorm buffers have none: an upper bound)
    assert tensor_bytes < _nbytes(want) + opt_bytes + 2 * 8192, (tensor_bytes, files)  # not two copies
    # a plain safetensors reader gives a state dict that loads into a fresh model
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(st.load_file(model_file))
    for k, v in want.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert (want["0.weight"] - _model().state_dict()["0.weight"]).abs().max() > 0  # training moved it
    # at another world size: 3 ranks (rank 2 did not exist: rank 0's view), and one process without init
    at3 = distributed(_load_other_world, np=3, args=(root,))
    for model_sd, _, shard, (lo, hi), step, n_opt in at3:
        assert step == 7 and n_opt == 6
        assert all(torch.equal(model_sd[k], v) for k, v in want.items())
        assert torch.equal(shard, torch.arange(8.0)[lo:hi])  # resharded from both saved pieces
    assert [float(m[0]) for _, m, *_ in at3] == [0.0, 1.0, 0.0]  # each rank's own, never merged
    model_sd, mine, shard, _, step, _ = _load_other_world(root)
    assert step == 7 and torch.equal(shard, torch.arange(8.0))
    assert all(torch.equal(model_sd[k], v) for k, v in want.items())
    # export: one consolidated file; Shards reassembled whole
    out = str(tmp_path / "shard.safetensors")
    assert ckpt.export(root, out, piece="shard") == {"shard": [8]}
    assert torch.equal(st.load_file(out)["shard"], torch.arange(8.0))
    # a file every rank reads is hashed by one rank only: damage in it still fails the load on every rank
    from phalanx.checkpoint import reader

    shared = reader.shared_files(ckpt.read_manifest(root))
    assert "model.safetensors" in shared and not any(f.startswith("rank") for f in shared), shared
    checker = reader.checker_of("model.safetensors", 2)
    data = bytearray(open(model_file, "rb").read())
    data[-5] ^= 0x10
    open(model_file, "wb").write(bytes(data))
    reports = distributed(_load_reports, np=2, args=(root,))
    assert "checksum" in reports[checker] and "does not match" in reports[checker], reports
    assert "failed its check on the rank that checked it" in reports[1 - checker], reports


def test_plan_balances_bytes_written_and_keeps_the_model_whole():
    """4 ranks holding the same model (16 x 4 MiB) and Adam state (32 x 4 MiB + step counters): the model
    is one file by one writer; the optimizer's tensors fill in around it, so no rank writes much more
    than its share (DCP: 48 MiB each). Before, one rank wrote the whole 128 MiB optimizer."""
    from phalanx.checkpoint.plan import make_plans

    mib = 1 << 20
    desc = {f"m{i}": [f"model/{i}.weight", [1024, 1024], "float32", [None, None], "", 4 * mib] for i in range(16)}
    for i in range(16):
        for k in ("exp_avg", "exp_avg_sq"):
            desc[f"o{i}{k}"] = [f"optim/state/{i}/{k}", [1024, 1024], "float32", [None, None], "", 4 * mib]
        desc[f"s{i}"] = [f"optim/state/{i}/step", [], "float32", [None, None], "00", 4]
    plans = make_plans([desc] * 4)
    written = [sum(desc[t][5] for t, (_, _, mine) in plans[r].items() if mine) for r in range(4)]
    assert max(written) <= 64 * mib + 64 and sum(written) == 192 * mib + 64, written
    model_files = {plans[r][f"m{i}"][0] for r in range(4) for i in range(16)}
    assert model_files == {"model.safetensors"}
    assert all(f.startswith("optim.part") for r in range(4) for t, (f, _, _) in plans[r].items() if t[0] in "os")
    assert plans == make_plans([desc] * 4)  # deterministic
    for t in desc:  # every tensor written by exactly one rank, the same file and name on every rank
        assert sum(plans[r][t][2] for r in range(4)) == 1 and len({tuple(plans[r][t][:2]) for r in range(4)}) == 1


def test_old_checkpoints_with_t0_names_still_load(tmp_path):
    """A version-2 checkpoint as phalanx wrote it before: one file per rank, tensors named t0…tN."""
    path = str(tmp_path / "old")
    os.makedirs(path)
    w, b = torch.randn(3, 2), torch.arange(3.0)
    digest = io.write_tensors(os.path.join(path, "rank00000.safetensors"), {"t0": w, "t1": b})
    records = {"t0": {"path": "model/weight", "shape": [3, 2], "dtype": "float32"},
               "t1": {"path": "model/bias", "shape": [3], "dtype": "float32"}}
    skeleton = {"__d__": [["model", {"__d__": [["weight", {"__tensor__": "t0"}], ["bias", {"__tensor__": "t1"}]]}],
                          ["step", 5]]}
    meta_digest = io.write_json(os.path.join(path, "rank00000.json"), {
        "nonce": "x-1", "rank": 0, "world_size": 1, "format": "safetensors", "tensor_file": "rank00000.safetensors",
        "tensor_checksum": digest, "records": records, "skeleton": skeleton, "meta": {}})
    io.write_json(os.path.join(path, ckpt.MANIFEST), {
        "version": 2, "nonce": "x-1", "world_size": 1, "format": "safetensors", "created": 0.0, "meta": {},
        "ranks": [{"tensor_file": "rank00000.safetensors", "tensor_checksum": digest, "meta_file": "rank00000.json",
                   "meta_checksum": meta_digest, "tensors": records}]})
    model = torch.nn.Linear(2, 3)
    state = {"model": model, "step": 0}
    ckpt.load(path, state)
    assert torch.equal(model.weight.detach(), w) and torch.equal(model.bias.detach(), b) and state["step"] == 5
    assert ckpt.export(path, str(tmp_path / "m.safetensors")) == {"weight": [3, 2], "bias": [3]}


_BREAKAGES = {
    "ranks is a number": lambda m: m.update(ranks=7),
    "world size a string": lambda m: m.update(world_size="1"),
    "a rank entry missing": lambda m: m["ranks"].pop(),
    "rank entry not an object": lambda m: m["ranks"].__setitem__(0, "rank0"),
    "meta file outside the directory": lambda m: m["ranks"][0].update(meta_file="../../etc/passwd"),
    "absolute tensor file": lambda m: m.update(files={"/etc/passwd": {"checksum": "crc32:0"}}),
    "dot-dot file name": lambda m: m.update(files={"..": {"checksum": "crc32:0"}}),
    "record names an unlisted file": lambda m: next(iter(m["ranks"][0]["tensors"].values())).update(file="x/../y"),
    "shape not integers": lambda m: next(iter(m["ranks"][0]["tensors"].values())).update(shape=["a"]),
    "checksum not a string": lambda m: next(iter(m["files"].values())).update(checksum=3),
    "top level a list": lambda m: (m.clear(), m.update(__list__=True)),
    "unknown version": lambda m: m.update(version=99),
}


@pytest.mark.parametrize("broken", sorted(_BREAKAGES))
def test_malformed_manifest_is_corrupt_and_load_latest_falls_back(tmp_path, broken):
    mgr = ckpt.CheckpointManager(str(tmp_path), keep=5)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step)), "step": step})
    mpath = tmp_path / "step-000000002" / ckpt.MANIFEST
    manifest = json.loads(mpath.read_text())
    _BREAKAGES[broken](manifest)
    mpath.write_text(json.dumps([] if manifest.get("__list__") else manifest))
    with pytest.raises(ckpt.CorruptCheckpointError, match="manifest"):
        ckpt.read_manifest(str(tmp_path / "step-000000002"))
    state = {"w": torch.zeros(4), "step": 0}
    assert mgr.load_latest(state).endswith("step-000000001")  # skipped, not a TypeError
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((4,), 1.0))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "phalanx", "checkpoint", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_export_cli_writes_one_plain_state_dict_and_user_errors_are_one_line(tmp_path):
    model, opt = _trained()
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(3, {"model": model, "optim": opt, "step": 3})
    out = tmp_path / "model.safetensors"
    done = _cli("export", str(tmp_path / "run"), str(out))  # a root: the newest checkpoint under it
    assert done.returncode == 0, done.stderr
    fresh = _model()
    fresh.load_state_dict(st.load_file(str(out)))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    everything = st.load_file(str(_cli_all(tmp_path)))
    assert "model/0.weight" in everything and "optim/state/0/exp_avg" in everything
    for args, says in (((str(tmp_path / "nowhere"), str(out)), "no such checkpoint directory"),
                       ((str(tmp_path / "run"), str(out), "--piece", "modle"), "has no piece 'modle'")):
        bad = _cli("export", *args)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    shutil.rmtree(tmp_path / "run")


def _cli_all(tmp_path):
    out = tmp_path / "all.safetensors"
    done = _cli("export", str(tmp_path / "run"), str(out), "--all")
    assert done.returncode == 0, done.stderr
    return out
