"""Train a small character-level GPT on the Python standard library's own source, in 3D parallel.

Run:
    phalanx run -np 4 python examples/train_gpt.py --dp 1 --pp 2 --tp 2
    phalanx run -np 4 python examples/train_gpt.py --dp 2 --pp 2 --tp 1 --schedule gpipe
    phalanx run -np 4 python examples/train_gpt.py --dp 2 --pp 2 --zero 1      # ZeRO-1 on the dp axis
    phalanx run -np 2 python examples/train_gpt.py --pp 2 --schedule interleaved_1f1b
    phalanx run -np 4 python examples/train_gpt.py --experts 8 --ep 2 --pp 2 --dp 1   # MoE blocks, experts over ep
    python examples/train_gpt.py                     # one process, same code

The corpus is every ``*.py`` file under the directory of ``os.py`` (sorted, read
until --corpus-mb), as bytes clipped to ASCII, so the vocabulary is 128 symbols —
which also divides evenly by any tensor-parallel size up to 128.
"""

import argparse
import os
import time

import torch

import phalanx as px
from phalanx.models import GPT, GPTConfig, gpt_tp_plan
from phalanx.parallel.grid import RankGrid
from phalanx.parallel.parallelize import parallelize
from phalanx.parallel.tensor import vocab_parallel_cross_entropy


def load_corpus(megabytes: float) -> torch.Tensor:
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        if "site-packages" in dirpath:
            continue
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
                if total >= megabytes * 2**20:
                    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clamp(max=127).long()
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clamp(max=127).long()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (needs --experts)")
    ap.add_argument("--experts", type=int, default=0, help="MoE blocks of this many experts (0: dense MLPs)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "eager_1f1b", "gpipe", "interleaved_1f1b"])
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage on the data-parallel axis (0: plain data parallel)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="sequences per data-parallel replica per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    ap.add_argument("--checkpoint", action="store_true", help="recompute stage activations in backward")
    args = ap.parse_args()

    px.init()
    mesh = RankGrid(dp=args.dp, pp=args.pp, tp=args.tp, ep=args.ep)
    text = load_corpus(args.corpus_mb)
    train = text

    torch.manual_seed(0)  # same initial weights everywhere; parallelize cuts them up
    cfg = GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                    n_experts=args.experts)
    model = GPT(cfg)
    plan = gpt_tp_plan(model) if args.tp > 1 else None

    def loss_fn(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, mesh.tp_group)

    pm = parallelize(model, mesh, loss_fn=loss_fn, tp_plan=plan, num_microbatches=args.microbatches,
                     schedule=args.schedule, checkpoint=args.checkpoint,
                     data_parallel=f"zero{args.zero}" if args.zero else "auto" if args.ep == 1 else "allreduce",
                     # AdamW spelled as Adam(decoupled_weight_decay=True): ZeRO rebuilds the optimizer
                     # from type(opt)(**opt.defaults), which torch's AdamW class refuses.
                     optimizer=lambda params: torch.optim.Adam(params, lr=args.lr, weight_decay=0.01,
                                                               decoupled_weight_decay=True))
    opt = pm.optimizer
    if px.rank() == 0:
        n_local = sum(p.numel() for p in pm.parameters())
        print(f"{mesh} corpus={len(text) / 1e6:.1f}M chars, stage bounds {pm.bounds}, "
              f"{n_local / 1e6:.2f}M params on rank 0")

    gen = torch.Generator().manual_seed(1234 + mesh.batch_index)  # each dp (x ep) slice draws its own batches
    t0 = time.perf_counter()
    for step in range(args.steps):
        # tp and pp peers of one replica must see the same batch: same seed within a replica
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq] for s in starts])
        y = torch.stack([train[s + 1 : s + args.seq + 1] for s in starts])
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if px.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
            tok_s = (step + 1) * args.batch * args.dp * args.ep * args.seq / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {loss.item():.3f}  {tok_s:,.0f} tokens/s")
    px.shutdown()


if __name__ == "__main__":
    main()
