"""`lethe bench`: benchmarks that print ratios measured side by side, one module a kind: decoding speed
(`speed`), quality tables (`quality`), a server under load (`load`), forgetting under attack (`attacks`), forget
requests one after another (`continual`)."""

from __future__ import annotations

import argparse

from lethe.clients.cli.bench import attacks, continual, load, quality, speed


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe bench ...`: the group, then each module's subcommands, in the order `lethe bench --help` lists them."""
    bench = sub.add_parser("bench", help="benchmarks that print ratios measured side by side"
                           ).add_subparsers(dest="bench", required=True)
    for module in (speed, quality, load, attacks, continual):
        module.register(bench)
