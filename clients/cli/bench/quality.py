"""`lethe bench t3-quality`, `real` and `asu-quality`: quality tables."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.common import _add_engine_args, _add_model_args, _engine_model


def register(bench: argparse._SubParsersAction) -> None:
    """`lethe bench t3-quality`, `real` and `asu-quality`."""
    p = bench.add_parser("t3-quality", help="the quality table: full model, reference, paper, default, ablations")
    _add_model_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--reference-model", type=Path, required=True, help="a model never trained on the forget set")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--out", type=Path, help="JSON reports (and a .md table beside it)")
    p.add_argument("--plot", type=Path, help="PNG of the first four rows")
    p.set_defaults(func=cmd_bench_quality)

    p = bench.add_parser("real", help="forget a topic a pretrained chat model knows: hits, retain, fluency",
                         description="Facts from templates that the model answers correctly; a head trained on one "
                                     "kind (--forget), the others kept; base and tilted answers greedy and sampled; "
                                     "hit rate, retain answers identical to the base model's, and the fluency of "
                                     "forget answers (non-words, repeated 3-grams, loops). Needs the bench extra "
                                     "(pip install 'lethe[bench]') for its English word list.")
    _add_model_args(p)
    p.add_argument("--forget", default="capital", choices=["capital", "currency", "continent", "element", "author"])
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"])
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--limit", type=int, default=None, help="subjects per kind, for a quick run (default: all)")
    p.add_argument("--settings", type=_json_object, default={},
                   help='tilt settings over the head\'s recommendation, as JSON, e.g. \'{"repeat_guard": 0}\'')
    p.add_argument("--variant", type=_named_json, action="append", default=[], metavar="NAME=JSON",
                   help="further settings to compare on the same head and base answers (repeatable); with "
                        "--asu-tau, one with adapter_above routes forget-like prompts to the ASU adapter")
    p.add_argument("--asu-tau", type=float, help="also train ASU at this tau on the same sets and report it alone "
                                                 "and with the head (variants asu, asu+head)")
    p.add_argument("--asu-steps", type=int, default=300, help="ASU training steps (default 300)")
    p.add_argument("--asu-layers", default=None, help="layers ASU's teacher tempers, e.g. 0-9 (default: all; "
                                                      "`lethe asu teacher` suggests them)")
    p.add_argument("--asu-retain-loss", choices=["gd", "kl"], default="gd")
    p.add_argument("--asu-retain-weight", type=float, default=1.0)
    p.add_argument("--asu-own-answers", action="store_true", help="distil along the model's own answers where "
                                                                   "they state the fact")
    p.add_argument("--asu-retain-own-answers", action="store_true", help="hold the student to the original "
                   "along the model's own answers to the retain questions (with --asu-retain-loss kl)")
    p.add_argument("--asu-distil", choices=["answer", "fact", "fact-out"], default="answer", help="where the "
                   "student follows the teacher: every answer token (default), or the fact's tokens only, the "
                   "original elsewhere (fact-out: the original without the fact's tokens)")
    p.add_argument("--asu-lora-layers", default=None, help="the layers ASU's LoRA adapters go in, e.g. 20-29 "
                   "(default: all)")
    p.add_argument("--asu-contexts", type=float, default=0.0, help="ASU also distils (and holds retain records) "
                   "after contexts, per forget record (default 0)")
    p.add_argument("--asu-student-answers", type=int, default=0, help="times during ASU's training the student "
                   "answers the forget questions and is distilled along the answers that still state the fact "
                   "(default 0)")
    p.add_argument("--asu-retain-subspace", type=float, default=0.0, help="ASU's adapters read their inputs with "
                   "the retain set's main directions (this share of their energy, e.g. 0.99) projected out "
                   "(default 0: off)")
    p.add_argument("--asu-gate", action="store_true", help="ASU with a gate (ASUConfig.gate; needs "
                   "--asu-lora-layers): its adapter acts only at the tokens the gate calls forget-like")
    p.add_argument("--asu-repeat-guard", type=int, default=0, help="also the variant 'asu guarded': ASU alone "
                   "with a repeat guard of this n on its rows, as an ASU profile's repeat_guard (default 0: none)")
    p.add_argument("--asu-adapter-above", type=float, default=0.5, help="the 'asu+head routed' variant: the "
                   "adapter only where the head's probe gives P(forget | prompt) above this (default 0.5)")
    p.add_argument("--asu-save", type=Path, help="write the ASU weights the bench trains to this file")
    p.add_argument("--asu-preset", choices=["lethe", "minimal"], help="also ASU, trained as a job that names only "
                   "the sets would: the teacher's pick and this preset's settings (the other --asu-* training "
                   "settings unused)")
    p.add_argument("--asu-weights", type=Path, help="ASU weights to use instead of training (from --asu-save or "
                   "`lethe asu train` on the same model; the --asu-* training settings are then unused)")
    _add_engine_args(p)
    p.add_argument("--out", type=Path, help="JSON report (and a .md table beside it)")
    p.set_defaults(func=cmd_bench_real)

    p = bench.add_parser("asu-quality", help="full, reference, T3, ASU at each tau, ASU + T3 (greedy), with times")
    _add_model_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--reference-model", type=Path, required=True)
    p.add_argument("--tau", type=float, nargs="+", default=[4.0, 16.0], help="ASU at each tau with the minimal "
                   "preset's other settings (default 4 16)")
    p.add_argument("--preset", choices=["lethe", "minimal", "none"], default="lethe", help="also ASU with this "
                   "preset's defaults and the teacher's pick, as a job that names no setting trains it (none: not)")
    p.add_argument("--out", type=Path, help="JSON reports (and a .md table beside it)")
    p.set_defaults(func=cmd_bench_asu)


def _table_run(args, header, row, make_rows) -> list:
    """Load the model, its reference and the sets; print a markdown table row by row; write JSON and .md."""
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    lm = load_model(args.model, args.device, args.dtype)
    reference = load_model(args.reference_model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    print(header(), flush=True)
    rows = make_rows(lm, reference, forget, retain, lambda line: print(line, flush=True))
    if args.out:
        atomic_write_text(args.out, json.dumps([{"label": label, **r} for label, r in rows], indent=2))
        atomic_write_text(args.out.with_suffix(".md"), "\n".join([header()] + [row(*r) for r in rows]) + "\n")
    return rows


def cmd_bench_quality(args) -> int:
    from lethe.server.bench.quality import markdown_header, markdown_row, quality_table
    from lethe.heads.evaluation.evaluate import EvalConfig, plot_reports

    rows = _table_run(args, markdown_header, markdown_row, lambda lm, ref, f, r, log: quality_table(
        lm, ref, f, r, EvalConfig(seeds=tuple(args.seeds)), log=log))
    if args.plot:
        plot_reports([{**r, "profile": label} for label, r in rows[:4]], args.plot)
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _named_json(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("must be NAME=JSON")
    return name, _json_object(rest)


def cmd_bench_real(args) -> int:
    from lethe.server.bench.real import RealBenchConfig, markdown, run
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.t3.train import FitConfig

    lm = load_model(args.model, args.device, args.dtype)
    cfg = RealBenchConfig(forget=args.forget, max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures),
                          top_p=args.top_p, seeds=tuple(args.seeds), limit=args.limit,
                          fit=FitConfig(format=args.format), settings=args.settings, variants=dict(args.variant),
                          asu_tau=args.asu_tau, asu_steps=args.asu_steps, asu_layers=args.asu_layers,
                          asu_retain_loss=args.asu_retain_loss, asu_retain_weight=args.asu_retain_weight,
                          asu_own_answers=args.asu_own_answers, asu_retain_own_answers=args.asu_retain_own_answers,
                          asu_distil=args.asu_distil, asu_lora_layers=args.asu_lora_layers,
                          asu_contexts=args.asu_contexts, asu_student_answers=args.asu_student_answers,
                          asu_retain_subspace=args.asu_retain_subspace, asu_repeat_guard=args.asu_repeat_guard,
                          asu_gate=args.asu_gate, asu_adapter_above=args.asu_adapter_above,
                          asu_save=args.asu_save and str(args.asu_save),
                          asu_weights=args.asu_weights and str(args.asu_weights), asu_preset=args.asu_preset)
    decoder = _engine_model(args, lm, 32)
    report = run(lm, cfg, log=lambda line: print(line, file=sys.stderr, flush=True), decoder=decoder)
    table = markdown(report)
    print(table)
    if args.out:
        atomic_write_text(args.out, json.dumps(report, indent=2))
        atomic_write_text(args.out.with_suffix(".md"), table)
    return 0


def cmd_bench_asu(args) -> int:
    from lethe.server.bench.quality import asu_header, asu_row, asu_table
    from lethe.heads.evaluation.evaluate import EvalConfig

    preset = None if args.preset == "none" else args.preset
    _table_run(args, asu_header, asu_row, lambda lm, ref, f, r, log: asu_table(
        lm, ref, f, r, tuple(args.tau), EvalConfig(seeds=()), log=log, preset=preset))
    return 0
