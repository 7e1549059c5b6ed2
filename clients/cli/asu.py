"""`lethe asu`: ASU adapters, trained offline or on the server; the server's adapters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.common import (_add_format_arg, _add_model_args, _add_resource_commands, _modes,
                                      _offline_inputs)


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe asu train`, `list`, `get` and `delete`."""
    from lethe.clients import remote

    asu = sub.add_parser("asu", help="ASU adapters: train offline or on the server; list, get, delete on the server"
                         ).add_subparsers(dest="asu", required=True)
    p = asu.add_parser("train", help="distil LoRA adapters towards a tempered-attention teacher (offline, or --url)")
    _add_model_args(p)
    p.add_argument("--forget", required=True, help="JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--preset", choices=["lethe", "minimal"], default=None,
                   help="the settings not given: lethe (default), the recipe measured best on SmolLM2 (adapters in "
                        "the tempered layers, own answers, KL retain loss weight 5 along the model's own retain "
                        "answers, 100 steps, a gate where the adapters start past the first layer); minimal, the "
                        "release before's (every layer, the sets' answers, gd weight 1, 300 steps, no gate)")
    p.add_argument("--tau", type=float, default=None, help="attention temperature of the teacher (default: the "
                   "pick of `lethe asu teacher` on the forget set, with its layers unless --layers is given; 16 "
                   "where no candidate qualifies)")
    p.add_argument("--layers", default=None, help="layers to temper, e.g. 0-1,3 (default: all, or the pick's)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--full-layers", default=None,
                   help="train these layers' projections in full instead of LoRA adapters, e.g. 0-1 "
                        "(stored as deltas; served as exact full-rank adapters)")
    p.add_argument("--lora-layers", default=None, help="put the LoRA adapters in these layers only, e.g. 20-29 "
                                                      "(default: lethe, the tempered layers; minimal, every layer)")
    p.add_argument("--own-answers", action=argparse.BooleanOptionalAction, default=None,
                   help="distil along the model's own answers where they state the record's `fact` (default: on "
                        "with --preset lethe)")
    p.add_argument("--retain-own-answers", action=argparse.BooleanOptionalAction, default=None,
                   help="hold the student to the original along its own answers to the retain questions "
                        "(with --retain-loss kl; default: on with --preset lethe and kl)")
    p.add_argument("--distil", choices=["answer", "fact", "fact-out"], default=None,
                   help="where the student follows the teacher: every answer token (answer, the default) or the "
                        "fact's tokens only (fact; fact-out: the fact's tokens also taken out of the original's "
                        "distributions at the other tokens)")
    p.add_argument("--contexts", type=float, default=None,
                   help="also distil each forget record (and hold twice as many retain records) after a context: "
                        "a preamble, a system prompt, earlier turns, other text (per forget record; default 0)")
    p.add_argument("--student-answers", type=int, default=None,
                   help="times during training the student answers the forget questions; where it still states "
                        "the record's `fact`, it is distilled along that answer too (default 0)")
    p.add_argument("--retain-subspace", type=float, default=None,
                   help="the adapters read their inputs with the retain set's main directions projected out: the "
                        "share of the retain inputs' energy they hold, e.g. 0.99 (default 0: off)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None,
                   help="train a gate with the adapters (needs adapters in chosen layers): the adapter acts only at "
                        "the tokens it calls forget-like; the torch engine serves it, llama.cpp refuses it (default: "
                        "on with --preset lethe where the adapters start past the first layer)")
    p.add_argument("--retain-loss", choices=["gd", "kl"], default=None, help="default: kl (lethe), gd (minimal)")
    p.add_argument("--retain-weight", type=float, default=None, help="default: 5 (lethe), 1 (minimal)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=None, help="at most; stops early when the forget KL stalls "
                                                           "(default: 100 (lethe), 300 (minimal))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    _add_format_arg(p)
    p.add_argument("--out", type=Path, help="weights file to write; offline only, required there")
    p.set_defaults(func=cmd_asu_train, remote=remote.asu_train)
    _modes(p, offline=["model", "device", "dtype", "out"], server=["wait"])
    _add_resource_commands(asu, "asu", "ASU weights")
    t = asu.add_parser("teacher", help="which attention temperature, in which layers, lowers the forget answers' "
                                       "facts more than their other tokens (offline)")
    _add_model_args(t)
    t.add_argument("--forget", required=True, type=Path, help="JSON Lines file of question/answer records (a "
                   "record's `fact` names its content tokens; otherwise words outside common function words)")
    t.add_argument("--taus", type=float, nargs="+", default=None, help="candidate temperatures (default "
                   "1.5 2 2.5 3 4 8)")
    t.add_argument("--layers", nargs="+", default=None, help="candidate layer sets, e.g. all 0-9 (default: all "
                   "and each third)")
    t.add_argument("--limit", type=int, default=64, help="records read (default 64); of those, the facts the "
                   "model knows (mean probability >= 0.5 on their content tokens) are measured")
    t.add_argument("--min-drop", type=float, default=1.0, help="least drop (nats) on content tokens a pick "
                   "needs (default 1.0)")
    t.add_argument("--min-flips", type=float, default=0.5, help="least share of facts whose first token stops "
                   "being the teacher's top token that a pick needs (default 0.5)")
    _add_format_arg(t)
    t.add_argument("--out", type=Path, help="also write the report here (JSON)")
    t.set_defaults(func=cmd_asu_teacher)


def cmd_asu_train(args) -> int:
    from lethe.heads.asu.distill import train_asu
    from lethe.heads.asu.presets import DEFAULT, FIELDS, configure, record
    from lethe.heads.asu.weights import save_asu

    lm, forget, retain = _offline_inputs(args, "asu train")
    preset = args.preset or DEFAULT
    said = {}  # the greedy answers the teacher decodes, which training reuses
    cfg, teacher = configure(lm, forget, {k: getattr(args, k) for k in FIELDS}, preset, memo=said)
    if teacher is not None and not args.quiet:
        print(f"teacher: tau {cfg.tau:g} on layers {cfg.layers or 'all'} ({teacher['reason']})", file=sys.stderr)
    tensors, info = train_asu(lm, forget, retain, cfg, progress=not args.quiet, memo=said)
    record(info, preset, teacher)
    save_asu(args.out, tensors, info)
    base_bytes = sum(f.stat().st_size for f in lm.path.glob("*.safetensors"))
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size,
                      "share_of_base": round(args.out.stat().st_size / max(1, base_bytes), 4), "steps": info.steps,
                      "tau": info.tau, "layers": info.layers,
                      **{k: v for k, v in info.metrics.items() if k not in ("forget_kl_history", "teacher")}}))
    return 0


def cmd_asu_teacher(args) -> int:
    """One JSON line per candidate setting (tau, layers, content and other drops, their ratio), then the pick."""
    from lethe.heads.asu.teacher import TAUS, diagnose, report
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    forget = read_jsonl(args.forget)
    lm = load_model(args.model, args.device, args.dtype)
    result = report(diagnose(lm, forget, args.taus or TAUS, args.layers, args.limit, args.format), args.min_drop,
                    args.min_flips)
    for setting in result["settings"]:
        print(json.dumps(setting))
    print(json.dumps({"pick": result["pick"], "min_drop": args.min_drop, "min_flips": args.min_flips}))
    if args.out is not None:
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0
