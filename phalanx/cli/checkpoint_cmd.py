"""``phalanx checkpoint export DIR OUT``: one plain safetensors file from a sharded checkpoint.

Example::

    phalanx checkpoint export ckpts out.safetensors                 # newest complete checkpoint, piece "model"
    phalanx checkpoint export ckpts/step-000000120 all.safetensors --all
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="work with phalanx checkpoints (export one plain state dict)",
                              description="Work with phalanx checkpoints.")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    e = sub.add_parser("export", help="write one consolidated safetensors file (a plain state dict)",
                       description="Write the tensors of one piece of a checkpoint (default 'model'), whole, "
                                   "under their state-dict keys, to one safetensors file.")
    e.add_argument("dir", help="a checkpoint directory, or a root of step-N checkpoints (the newest is used)")
    e.add_argument("out", help="the safetensors file to write")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--piece", default="model", help="the piece of the saved state to export (default model)")
    which.add_argument("--all", action="store_true", help="every piece, keys prefixed '<piece>/'")
    e.set_defaults(func=export_main)
    p.set_defaults(func=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    print("phalanx checkpoint: name an action (export)", file=sys.stderr)
    return 2


def export_main(args: argparse.Namespace) -> int:
    from phalanx.checkpoint import CorruptCheckpointError, ExportError, export

    try:
        written = export(args.dir, args.out, piece=None if args.all else args.piece)
    except (ExportError, CorruptCheckpointError, OSError) as err:
        print(f"phalanx checkpoint export: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    total = sum(1 for _ in written)
    print(f"wrote {total} tensor(s) to {args.out}")
    return 0
