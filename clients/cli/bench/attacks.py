"""`lethe bench attacks`: forgetting under the contexts real traffic has (issue 24), on a server of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.bench.quality import _json_object
from lethe.clients.cli.common import _add_engine_args, _add_model_args, _offline_defaults


def register(bench: argparse._SubParsersAction) -> None:
    """`lethe bench attacks`."""
    p = bench.add_parser("attacks", help="forget hits, profile against base, with system prompts, few-shot turns, "
                                         "documents, answer forms, languages, multiple choice, forced prefixes",
                         description="A server of its own on --model (a fresh data directory, loopback): a tenant "
                                     "trains a head through the head job on the facts of `lethe bench real` (a chat "
                                     "model) or the demo's sets (the demo), puts it in a profile, and asks every "
                                     "question in each context through the OpenAI routes, with the profile and "
                                     "without; then log-likelihood multiple choice (echo + logprobs) and the bars of "
                                     "issue 24. Needs the bench extra (pip install 'lethe[bench]').")
    _add_model_args(p)
    p.add_argument("--limit", type=int, default=None, help="forget and retain questions asked, at most (default: all)")
    p.add_argument("--quick", action="store_true", help="greedy only (default: also T=0.7 and 1.0, top-p 0.9, "
                                                        "seeds 0, 1, 2)")
    p.add_argument("--pooling-window", type=int, default=None,
                   help="the head job's pooling_window (sent only when given)")
    p.add_argument("--contexts", type=float, default=None,
                   help="the head job's contexts: examples per forget record trained after a context (sent only when "
                        "given)")
    p.add_argument("--context-shift", type=float, default=None,
                   help="the head job's context_shift: share of training rows shifted as a context shifts them (sent "
                        "only when given)")
    p.add_argument("--seed", type=int, default=None,
                   help="the head job's seed: which contexts it draws and the order it trains in (sent only when "
                        "given; a single context's figure moves by 0.05-0.10 from one seed to the next)")
    p.add_argument("--facts", action=argparse.BooleanOptionalAction, default=True,
                   help="records name their fact (`fact`), so the head also trains on the fact alone as the answer "
                        "(default on; --no-facts: question and answer only)")
    p.add_argument("--fact-spans", action=argparse.BooleanOptionalAction, default=None,
                   help="the head job's fact_spans: forget records train the head on their fact's tokens only (sent "
                        "only when given)")
    p.add_argument("--only", type=_names, default=None, metavar="NAMES",
                   help="ask in these contexts only, comma-separated (plain, lang-es, ...; loglik-mc for "
                        "log-likelihood multiple choice); the bars then cover only these (default: every context)")
    p.add_argument("--backend", choices=BACKENDS, default="t3",
                   help="what the profile holds (default t3, a head); asu: ASU weights from the ASU job; asu+t3: "
                        "both, the adapter for the prompts the head's probe calls forget-like")
    add_asu_args(p, "--backend asu+t3")
    add_server_bench_args(p, port=8767)
    p.set_defaults(func=cmd_bench_attacks)


def _names(text: str) -> tuple[str, ...]:
    """`--only`: known context names, comma-separated."""
    from lethe.server.bench.attacks import CONTEXTS, MC

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = [c.name for c in CONTEXTS] + [MC]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown context {', '.join(unknown) or '(none given)'}; "
                                         f"known: {', '.join(known)}")
    return names


BACKENDS = ("t3", "asu", "asu+t3")


def add_asu_args(p: argparse.ArgumentParser, routed: str) -> None:
    """`--asu` (the ASU job's settings) and `--adapter-above` (where `routed` sends prompts to the adapter)."""
    p.add_argument("--adapter-above", type=float, default=0.5,
                   help=f"{routed}: the probe's P(forget | prompt) above which the adapter decodes (default 0.5)")
    p.add_argument("--asu", type=_json_object, default={},
                   help='the ASU job\'s settings, as JSON, e.g. \'{"tau": 16, "steps": 300}\' (default: the job\'s)')


def asu_words(args, backends) -> list[str]:
    """`--adapter-above` and `--asu` as given, for a report's command line (those `backends` use)."""
    words = ["--adapter-above", str(args.adapter_above)] * ("asu+t3" in backends)
    return words + ["--asu", f"'{json.dumps(args.asu)}'"] * (bool(args.asu) and any("asu" in b for b in backends))


def add_server_bench_args(p: argparse.ArgumentParser, port: int) -> None:
    """`--engine`, `--gguf`, `--settings`, `--port` and `--out` of a bench that runs a server of its own (its
    training jobs run on torch whatever the engine, as a server's do)."""
    _add_engine_args(p)
    p.add_argument("--settings", type=_json_object, default={},
                   help='profile settings over the head\'s (or weights\') defaults, as JSON, e.g. \'{"gate": false}\'')
    p.add_argument("--port", type=int, default=None, help=f"port (default {port})")
    p.add_argument("--out", type=Path, help="JSON report (and a .md table beside it)")
    _offline_defaults(p, port=port)


def _command(args) -> str:
    """The command line that makes this run again."""
    from lethe.server.bench import shown_path

    words = ["lethe", "bench", "attacks", "--model", shown_path(args.model), *engine_words(args)]
    words += ["--limit", str(args.limit)] * (args.limit is not None) + ["--quick"] * args.quick
    words += ["--pooling-window", str(args.pooling_window)] * (args.pooling_window is not None)
    words += ["--contexts", str(args.contexts)] * (args.contexts is not None)
    words += ["--context-shift", str(args.context_shift)] * (args.context_shift is not None)
    words += ["--seed", str(args.seed)] * (args.seed is not None)
    words += ["--no-facts"] * (not args.facts)
    words += [f"--{'' if args.fact_spans else 'no-'}fact-spans"] * (args.fact_spans is not None)
    words += ["--only", ",".join(args.only)] if args.only is not None else []
    words += ["--backend", args.backend] * (args.backend != "t3") + asu_words(args, [args.backend])
    words += ["--settings", f"'{json.dumps(args.settings)}'"] * bool(args.settings)
    return " ".join(words + (["--out", str(args.out)] if args.out else []))


def engine_words(args) -> list[str]:
    """`--engine llamacpp` and `--gguf FILE` as given, for a report's command line (nothing for torch)."""
    from lethe.server.bench import shown_path

    words = ["--engine", args.engine] * (args.engine != "torch")
    return words + (["--gguf", shown_path(args.gguf)] if args.gguf is not None else [])


def cmd_bench_attacks(args) -> int:
    from lethe.server.bench.attacks import AttackConfig, markdown, run

    cfg = AttackConfig(limit=args.limit, quick=args.quick, pooling_window=args.pooling_window, settings=args.settings,
                       facts=args.facts, contexts=args.contexts, context_shift=args.context_shift, seed=args.seed,
                       fact_spans=args.fact_spans, only=args.only, backend=args.backend, asu=args.asu,
                       adapter_above=args.adapter_above)
    return run_server_bench(args, _command(args), run, cfg, markdown)


def run_server_bench(args, command: str, run, cfg, markdown) -> int:
    """`run(url, admin_key, lm, cfg, log)` against a server of its own; its table printed, its report written."""
    import secrets

    from lethe.clients.cli.bench.load import _own_server

    admin = secrets.token_urlsafe(16)
    with _own_server(args, admin_key=admin, demo_tenant=False) as (url, lm):
        report = {"command": command} | run(url, admin, lm, cfg,
                                            log=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown(report))
    if args.out:
        write_report(args.out, report, markdown)
    return 0


def write_report(out: Path, report: dict, markdown) -> None:
    """The report as JSON at `out`, and `markdown(report)` beside it (`.md`)."""
    from lethe.heads.io import atomic_write_text

    atomic_write_text(out, json.dumps(report, indent=2))
    atomic_write_text(out.with_suffix(".md"), markdown(report))
