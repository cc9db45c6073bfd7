"""The `wsattn` console script. Each subcommand lives with the code it drives and
registers itself through an ``add_parser(subparsers)`` function returning its parser,
whose ``func`` default runs it; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand module -> the module that provides add_parser(subparsers)
SUBCOMMANDS = (
    "wsattn.bench.cli",      # wsattn bench
    "wsattn.evidence.cli",   # wsattn ladder, wsattn targets
    "wsattn.engine.cli",     # wsattn generate
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsattn", description="Warp-specialized attention kernels: benchmarks and evidence.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"wsattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a subcommand not built yet must not break the others
            if e.name and e.name.startswith("wsattn"):
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
