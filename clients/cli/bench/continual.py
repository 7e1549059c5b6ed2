"""`lethe bench continual`: forget requests one after another, each applied to a profile (issue 26)."""

from __future__ import annotations

import argparse
import sys

from lethe.clients.cli.bench.attacks import BACKENDS, add_asu_args, add_server_bench_args, asu_words, engine_words, \
    run_server_bench
from lethe.clients.cli.common import _add_model_args


def register(bench: argparse._SubParsersAction) -> None:
    """`lethe bench continual`."""
    p = bench.add_parser("continual", help="forget requests arriving one after another: after each, is every "
                                           "earlier one still forgotten and retain still answered as before?",
                         description="A server of its own on --model (a fresh data directory, loopback). The forget "
                                     "subjects of `lethe bench attacks` are dealt into --requests disjoint groups; "
                                     "request k trains a head (t3) or ASU weights (asu) through the server's job on "
                                     "the union of groups 1..k and sets the backend's profile to them; then every "
                                     "group's questions are asked with the profile and without (greedy). Needs the "
                                     "bench extra (pip install 'lethe[bench]').")
    _add_model_args(p)
    p.add_argument("--requests", type=int, default=5, help="forget requests (disjoint groups), default 5")
    p.add_argument("--from-request", type=int, default=1, metavar="K",
                   help="run requests K..--requests only (default 1): request k trains from the base on groups "
                        "1..k, so K = --requests measures the last request, where the bars are read, alone")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["t3"],
                   help="backends measured one after the other (default t3); asu+t3: ASU weights and a head in one "
                        "profile, the adapter for the prompts the head's probe calls forget-like")
    p.add_argument("--limit", type=int, default=None, help="retain questions asked, at most (default: all)")
    add_asu_args(p, "backend asu+t3")
    add_server_bench_args(p, port=8768)
    p.set_defaults(func=cmd_bench_continual)


def _command(args) -> str:
    """The command line that makes this run again."""
    import json

    from lethe.server.bench import shown_path

    words = ["lethe", "bench", "continual", "--model", shown_path(args.model), *engine_words(args),
             "--requests", str(args.requests), "--backends", *args.backends]
    words += ["--from-request", str(args.from_request)] * (args.from_request != 1)
    words += ["--limit", str(args.limit)] * (args.limit is not None)
    words += asu_words(args, args.backends)
    words += ["--settings", f"'{json.dumps(args.settings)}'"] * bool(args.settings)
    return " ".join(words + (["--out", str(args.out)] if args.out else []))


def cmd_bench_continual(args) -> int:
    from lethe.server.bench.continual import ContinualConfig, markdown, run

    if args.requests < 1:
        print("lethe bench continual: --requests must be at least 1", file=sys.stderr)
        return 2
    if not 1 <= args.from_request <= args.requests:
        print(f"lethe bench continual: --from-request must be in [1, --requests ({args.requests})], got "
              f"{args.from_request}", file=sys.stderr)
        return 2
    cfg = ContinualConfig(requests=args.requests, first=args.from_request, backends=tuple(args.backends),
                          limit=args.limit, asu=args.asu,
                          settings=args.settings, adapter_above=args.adapter_above)
    return run_server_bench(args, _command(args), run, cfg, markdown)
