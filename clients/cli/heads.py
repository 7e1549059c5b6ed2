"""`lethe heads`: T3 heads, trained offline or on the server; the server's heads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lethe.heads.t3.pooling import DEFAULT_WINDOW

from lethe.clients.cli.common import (_add_format_arg, _add_model_args, _add_resource_commands, _modes,
                                      _offline_inputs)


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe heads train`, `list`, `get`, `delete` and `import-reference`."""
    from lethe.clients import remote

    heads = sub.add_parser("heads", help="T3 heads: train offline or on the server; list, get, delete on the server"
                           ).add_subparsers(dest="heads", required=True)
    p = heads.add_parser("train", help="fit a head: offline, or on the server with --url",
                         description="Offline (no --url / $LETHE_URL, or --local): cache the model's states over "
                                     "the sets and fit a head to --out. On the server (--url or $LETHE_URL): start "
                                     "a job (sets given as dataset ids or local files, which are uploaded first); "
                                     "--wait follows it with a progress bar. Options of the other mode are "
                                     "refused, never ignored.")
    _add_model_args(p)
    p.add_argument("--forget", required=True, help="forget set: JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="retain set: JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--epochs", type=int, default=60, help="at most; early stopping on a held-out split")
    p.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                   help="weight forget and retain positions equally (default on)")
    p.add_argument("--common-df", type=float, default=0.05,
                   help="forget tokens found in more than this share of retain answers do not train the head "
                        "(1.0: all do, as in the reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pooling-window", type=int, default=DEFAULT_WINDOW,
                   help="the head reads the mean of the last N tokens' states, so text before the question does not "
                        f"dilute it; 0: the whole context's mean, as the published T3 (default {DEFAULT_WINDOW})")
    p.add_argument("--answer-forms", action=argparse.BooleanOptionalAction, default=True,
                   help="records with a `fact` field also train with the fact alone as the answer (default on)")
    p.add_argument("--fact-spans", action=argparse.BooleanOptionalAction, default=None,
                   help="a forget record with a `fact` field trains the head as forget on the fact's tokens and on "
                        "words no retain answer uses, its other words the gate's probe alone (default off: "
                        "--common-df alone decides)")
    p.add_argument("--contexts", type=float, default=1.0,
                   help="examples per forget record (and twice as many retain ones) that train after a context (a "
                        "preamble, a system prompt, earlier turns, other text); 0: off (default 1.0)")
    p.add_argument("--context-shift", type=float, default=0.0,
                   help="share of training rows that also get a context's change of the pooled state, drawn from "
                        "what the trained contexts did to the same answers; 0: off (default; see docs/forgetting-in-context.md)")
    p.add_argument("--gate-answers", type=int, default=None,
                   help="retain questions the base model answers once the head is fitted, to set the head's "
                        "recommended head_gate one nat past the lowest head logit of a token those answers chose; "
                        "0: no head_gate (default 64)")
    p.add_argument("--cache-precision", choices=("auto", "model"), default=None,
                   help="the dtype of the cache pass's matrix products: auto, bfloat16 for a float32 model on a CPU "
                        "that computes it natively (about twice as fast), the model's own elsewhere; model, always "
                        "the model's own (default auto)")
    p.add_argument("--quiet", action="store_true")
    _add_format_arg(p)
    p.add_argument("--out", type=Path, help="head file to write (safetensors); offline only, required there")
    p.set_defaults(func=cmd_heads_train, remote=remote.heads_train)
    _modes(p, offline=["model", "device", "dtype", "out"], server=["wait"])
    _add_resource_commands(heads, "heads", "heads")

    p = heads.add_parser("import-reference", help="convert an open-unlearning T3 save into a Lethe head")
    _add_model_args(p)
    p.add_argument("reference", type=Path, help="the reference's saved model directory")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_heads_import)


def cmd_heads_train(args) -> int:
    from lethe.heads.t3.head import save_head
    from lethe.heads.t3.pipeline import train_head
    from lethe.heads.t3.train import FitConfig

    lm, forget, retain = _offline_inputs(args, "heads train")
    cfg = FitConfig(rank=args.rank, lr=args.lr, weight_decay=args.weight_decay, max_epochs=args.epochs,
                    balance=args.balance, common_df=args.common_df, seed=args.seed, format=args.format,
                    pooling_window=args.pooling_window, answer_forms=args.answer_forms, contexts=args.contexts,
                    context_shift=args.context_shift,
                    **({} if args.gate_answers is None else {"gate_answers": args.gate_answers}),
                    **({} if args.fact_spans is None else {"fact_spans": args.fact_spans}),
                    **({} if args.cache_precision is None else {"cache_precision": args.cache_precision}))
    head, info = train_head(lm, forget, retain, cfg, progress=not args.quiet)
    save_head(args.out, head, info)
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size, **info.metrics}))
    return 0


def cmd_heads_import(args) -> int:
    from lethe.heads.t3.head import save_head
    from lethe.heads.modelio import load_model
    from lethe.heads.t3.reference import import_reference

    lm = load_model(args.model, args.device, args.dtype)
    cfg = lm.model.config
    head, info = import_reference(args.reference, lm.fingerprint, cfg.hidden_size, cfg.vocab_size,
                                  cfg.num_hidden_layers)
    save_head(args.out, head, info)
    print(json.dumps({"out": str(args.out), "profile": info.profile}))
    return 0
