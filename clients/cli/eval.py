"""`lethe eval`: TOFU-style evaluation, on the server or offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lethe.clients.cli.common import (_PROFILE_DESTS, UsageError, _add_format_arg, _add_model_args,
                                      _add_profile_args, _modes, _profile, _with_asu)


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe eval`."""
    from lethe.clients import remote

    p = sub.add_parser("eval", help="TOFU-style evaluation of the base model or a head profile")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", required=True, help="TOFU JSON Lines (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="TOFU JSON Lines (or, with --url, a dataset id)")
    p.add_argument("--profile", help="with --url: the profile to evaluate (default: base)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--quiet", action="store_true", help="with --url: no progress bar")
    p.add_argument("--reference-model", type=Path, help="a model never trained on the forget set (forget quality)")
    p.add_argument("--retain-limit", type=int, default=None,
                   help="evaluate an even spread of this many retain records (offline)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="sampling seeds (temperature 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    _add_format_arg(p)
    p.add_argument("--name", help="profile name in the report")
    p.add_argument("--out", type=Path, help="JSON report (offline; required there)")
    p.add_argument("--plot", type=Path, help="PNG plot (offline)")
    p.set_defaults(func=cmd_eval, remote=remote.evaluate)
    _modes(p, offline=["model", "device", "dtype", *_PROFILE_DESTS, "reference_model", "retain_limit", "name",
                       "out", "plot"], server=["profile", "wait"])


def cmd_eval(args) -> int:
    from lethe.heads.evaluation.evaluate import EvalConfig, Profile, evaluate, plot_reports
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    if args.out is None:
        raise UsageError("eval: --out is required offline")
    lm = load_model(args.model, args.device, args.dtype)
    head, settings = _profile(args, lm)
    lm = _with_asu(args, lm)
    reference = load_model(args.reference_model, args.device, args.dtype) if args.reference_model else None
    forget, retain = read_jsonl(Path(args.forget)), read_jsonl(Path(args.retain))
    if args.retain_limit:
        retain = retain[:: max(1, len(retain) // args.retain_limit)][: args.retain_limit]
    name = args.name or "+".join(filter(None, ["asu" if args.asu else None,
                                                ("t3-" + (args.preset or "head")) if head is not None else None])) \
        or "base"
    profile = Profile(name, head, settings, "asu_cli" if args.asu else None,  # its rows as a server decodes them
                      getattr(args, "asu_repeat_guard", 0) if head is None else 0)
    report = evaluate(lm, forget, retain, profile, reference,
                      cfg=EvalConfig(max_new_tokens=args.max_new_tokens, seeds=tuple(args.seeds), format=args.format))
    atomic_write_text(args.out, json.dumps(report, indent=2))
    if args.plot:
        plot_reports([report], args.plot)
    summary = {k: report[k] for k in ("profile", "settings", "model_utility", "forget_quality") if k in report}
    summary |= {f"forget_{k}": v for k, v in report["forget"].items() if k != "examples"}
    summary |= {f"retain_{k}": v for k, v in report["retain"].items() if k != "examples"}
    print(json.dumps(summary, indent=1))
    return 0
