"""The ``phalanx`` command. Each subcommand lives in its own module.

A subcommand module defines ``register(subparsers)``, which adds its parser and
sets ``func`` to a callable taking the parsed arguments and returning an exit
code. Add a module to ``_SUBCOMMANDS`` to add a command; this file holds no
command logic of its own.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = (
    "phalanx.cli.run_cmd",
    "phalanx.cli.demo",
    "phalanx.cli.cluster_cmd",
    "phalanx.cli.bench_cmd",
    "phalanx.cli.plan_cmd",
    "phalanx.cli.report_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Distributed training for PyTorch: launch, demo, benchmark and plan.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
