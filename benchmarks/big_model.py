"""Seed 002's third scenario: 4 ranks, a memory budget per rank, the largest Llama each system can train.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/big_model.py [--device cpu|cuda] [--np 4]
          [--budget-mib 1024] [--sizes 256x4,384x6,512x8] [--seq 128] [--batch 2] [--steps 2]
          [--systems phalanx,phalanx-32bit,phalanx-tp,phalanx-pp,fsdp2,deepspeed]
      On the CPU each rank sets glibc's mmap threshold to 64 KiB (mallopt) so RSS follows live bytes.

Model: Hugging Face ``LlamaForCausalLM`` from a config with random weights, ``HxL`` = hidden size
H and L decoder layers, H/64 heads of 64, H/256 key/value heads (at least 1), MLP 8H/3 (rounded to
64), vocabulary ``--vocab`` (default 8192), untied head, sequence ``--seq``, ``--batch`` sequences a
rank (the pipeline gets the same global batch), AdamW, bf16 compute. Systems:

* ``phalanx``: ``px.zero(stage=3, mixed_precision="bf16", state_bits=8)`` and HF's activation
  checkpointing per decoder layer (non-reentrant), the configuration issue 40 builds.
* ``phalanx-32bit``: the same with fp32 Adam state (what the 8-bit state saves).
* ``phalanx-tp``: ``parallelize(model, RankGrid(dp=np/2, tp=2), data_parallel="zero3", checkpoint=True,
  zero_options={"mixed_precision": "bf16", "state_bits": 8})``: Megatron's plan over tp pairs (each pair
  the rows of both its ranks), ZeRO-3 over the dp ranks, every decoder layer recomputed, 8-bit state.
* ``phalanx-pp``: the model cut by module path into np stages (parameter-balanced), 1F1B over 2np
  micro-batches (np with an odd --batch), recomputation per stage, bf16 weights, 8-bit Adam state.
* ``fsdp2``: torch's ``fully_shard`` per decoder layer and on the root, bf16 parameters and fp32
  gradient reduction (``MixedPrecisionPolicy``), the same activation checkpointing, AdamW fp32.
* ``deepspeed``: ``deepspeed.initialize`` with ZeRO stage 3, bf16, torch's AdamW, the same checkpointing;
  where it cannot run, the one line it failed with is printed in its row.

Each (system, size) runs in fresh ranks; sizes go up until the system no longer fits. Peak per
rank: on CUDA ``torch.cuda.max_memory_allocated`` over the steps (reset after wrapping; from then
on the process is capped at the budget with ``set_per_process_memory_fraction``, so over-budget is
an out-of-memory error; building the full model before it is sharded is not counted, for any
system); on the CPU the rise of the peak resident set (VmHWM, reset after wrapping
via /proc/self/clear_refs) over the resident set before the model was built. "fits" = trained
``--steps`` steps within the budget. Step time: the median of the steps after the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px

SYSTEMS = ["phalanx", "phalanx-32bit", "phalanx-tp", "phalanx-pp", "fsdp2", "deepspeed"]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _mmap_threshold(nbytes: int) -> bool:
    """glibc's ``M_MMAP_THRESHOLD``, set in this process: blocks from ``nbytes`` up get their own mapping,
    returned to the system when freed, so the resident set follows live bytes. The environment
    variable ``MALLOC_MMAP_THRESHOLD_`` would not do: ranks are forks of a forkserver whose malloc
    was set up before any rank's environment (runs 1 and 2 of LOG.md were measured that way)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, nbytes) == 1  # M_MMAP_THRESHOLD = -3
    except OSError:
        return False


def _llama(h, layers, vocab, seq):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=h // 64,
                      num_key_value_heads=max(1, h // 256), intermediate_size=(8 * h // 3) // 64 * 64,
                      vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=seq,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    return LlamaForCausalLM(cfg)


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _wrap(system, m, batch, np_):
    """(step function, model) for one system; the model is already on the device."""
    import torch.distributed as dist

    if system in ("phalanx", "phalanx-32bit"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, opt = px.zero(m, torch.optim.AdamW(m.parameters(), lr=1e-4), stage=3, mixed_precision="bf16",
                             state_bits=8 if system == "phalanx" else 32)

        def step(x, y):
            opt.zero_grad()
            loss = _ce(model(input_ids=x).logits, y)
            loss.backward()
            opt.step()
            return loss.item()

        return step
    if system == "phalanx-pp":
        from phalanx.optim import Adam8bit
        from phalanx.parallel.pipeline import PipelineStage, partition, split_by_path

        m.to(torch.bfloat16)
        stage_model = split_by_path(m, partition(m, np_, method="parameters").boundaries(m), px.rank())
        pipe = PipelineStage(stage_model, px.rank(), np_, loss_fn=_ce, checkpoint=True)
        opt = Adam8bit(stage_model.parameters(), lr=1e-4, decoupled_weight_decay=True, weight_decay=0.01)
        m_micro = 2 * np_ if batch % 2 == 0 else np_  # micro-batches must split the global batch (batch·np rows)

        def step(x, y):
            xs = [torch.empty_like(x) for _ in range(np_)]
            ys = [torch.empty_like(y) for _ in range(np_)]
            dist.all_gather(xs, x)  # the pipeline takes the global batch on its first stage
            dist.all_gather(ys, y)
            opt.zero_grad()
            loss = pipe.step(torch.cat(xs) if pipe.is_first else None, torch.cat(ys) if pipe.is_last else None,
                             num_microbatches=m_micro)
            opt.step()
            return float(pipe.share_loss(loss))

        return step
    if system == "phalanx-tp":
        from phalanx.parallel.grid import RankGrid
        from phalanx.parallel.parallelize import parallelize
        from phalanx.parallel.tensor import vocab_parallel_cross_entropy

        mesh = RankGrid(dp=np_ // 2, tp=2)
        pm = parallelize(m, mesh, data_parallel="zero3", checkpoint=True,
                         loss_fn=lambda out, y: vocab_parallel_cross_entropy(out.float(), y, mesh.tp_group),
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
                         zero_options={"mixed_precision": "bf16", "state_bits": 8})

        def step(x, y):
            xs = [torch.empty_like(x) for _ in range(2)]
            ys = [torch.empty_like(y) for _ in range(2)]
            dist.all_gather(xs, x, group=mesh.tp_group)  # a tp pair takes both ranks' rows together
            dist.all_gather(ys, y, group=mesh.tp_group)
            pm.optimizer.zero_grad()
            loss = pm.step(torch.cat(xs), torch.cat(ys))
            pm.optimizer.step()
            return loss.item()

        return step
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        device = next(m.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step(x, y):
            opt.zero_grad()
            loss = _ce(m(input_ids=x).logits, y)
            loss.backward()
            opt.step()
            return loss.item()

        return step
    if system == "deepspeed":
        import deepspeed

        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cfg = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 3},
               "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
        # torch's AdamW as the client optimizer: DeepSpeed's own (FusedAdam) compiles a CUDA extension
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4),
                                          config=cfg, dist_init_required=False)

        def step(x, y):
            loss = _ce(engine(input_ids=x).logits, y)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step
    raise ValueError(f"unknown system {system!r}")


def _bench(system, h, layers, vocab, seq, batch, steps, budget):
    import torch.distributed as dist

    device = px.topology().device
    cuda = device.type == "cuda"
    dist.barrier()
    dist.broadcast(torch.zeros(4, device=device), src=0)  # connections before the baseline
    import transformers.models.llama.modeling_llama  # noqa: F401  (its import is not the model's memory)

    if system == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"}
    if not cuda and not _mmap_threshold(65536):
        return {"ok": False, "error": "could not set glibc's mmap threshold (not glibc?): RSS would not follow live bytes"}
    base = torch.cuda.memory_allocated(device) if cuda else _rss()
    try:
        with device:  # every system starts from the full model on every rank (none builds on meta here)
            m = _llama(h, layers, vocab, seq)
        psi = sum(p.numel() for p in m.parameters())
        step = _wrap(system, m, batch, px.size())
        del m
        g = torch.Generator().manual_seed(px.rank())
        x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        if cuda:
            import gc

            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            # the budget, from here on: what the wrapped model holds plus what its steps allocate
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (budget + base) / total), device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM: the peak from here on
        times, losses = [], []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(step(x, y))
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated(device) if cuda else _hwm()) - base
        return {"ok": True, "psi": psi, "peak": peak, "step_s": statistics.median(times[1:] or times),
                "loss": losses[-1]}
    except Exception as e:  # out of memory, or the system cannot run here: one line for the table
        line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
        return {"ok": False, "error": line}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--budget-mib", type=float, default=1024)
    ap.add_argument("--sizes", default="256x4,384x6,512x8,768x8,1024x8")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    a = ap.parse_args()
    systems = [s for s in a.systems.split(",") if s]
    if any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems: choose from {SYSTEMS}")
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    budget = int(a.budget_mib * 2**20)
    env = {"PHALANX_BACKEND": "gloo"}
    if a.device == "cuda":
        env["PHALANX_DEVICE"] = "cuda:0"  # every rank on the one GPU, gloo (NCCL needs a GPU per rank)
    print(f"device {a.device}, np={a.np}, budget {a.budget_mib:.0f} MiB/rank, seq {a.seq}, batch {a.batch}/rank, "
          f"vocab {a.vocab}, {a.steps} steps, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows = {}
    for system in systems:
        for h, layers in sizes:
            try:
                res = px.run(_bench, np=a.np, args=(system, h, layers, a.vocab, a.seq, a.batch, a.steps, budget),
                             timeout=a.timeout, env=env)
            except Exception as e:
                res = [{"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}]
            ok = all(r["ok"] for r in res) and max(r["peak"] for r in res) <= budget
            r0 = next((r for r in res if not r["ok"]), res[0])
            row = {"ok": ok, "error": r0.get("error")}
            if all(r["ok"] for r in res):
                row.update(psi=res[0]["psi"], peak=max(r["peak"] for r in res),
                           step_s=statistics.mean(r["step_s"] for r in res), loss=res[0]["loss"])
            rows[(system, h, layers)] = row
            what = (f"peak {row['peak'] / 2**20:.0f} MiB, {row['step_s']:.2f} s/step, {row['psi'] / 1e6:.1f}M params"
                    if "peak" in row else row["error"])
            print(f"  {system:14s} {h}x{layers}: {'fits' if ok else 'does not fit'}: {what}", flush=True)
            if not ok:
                break
    print("\n| system | largest that fits | params | peak MiB/rank | s/step | vs fsdp2 at that size (peak, time) |")
    print("|---|---|---|---|---|---|")
    for system in systems:
        fit = [(k, r) for k, r in rows.items() if k[0] == system and r["ok"]]
        if not fit:
            err = next((r["error"] for k, r in rows.items() if k[0] == system), "")
            print(f"| {system} | none | - | - | - | {err} |")
            continue
        (_, h, layers), r = max(fit, key=lambda kr: kr[1]["psi"])
        peer = rows.get(("fsdp2", h, layers))
        vs = (f"{r['peak'] / peer['peak']:.2f}x peak, {r['step_s'] / peer['step_s']:.2f}x time"
              if peer and "peak" in peer and system != "fsdp2" else "")
        print(f"| {system} | {h}x{layers} | {r['psi'] / 1e6:.1f}M | {r['peak'] / 2**20:.0f} | {r['step_s']:.2f} | {vs} |")


if __name__ == "__main__":
    main()
