"""`lethe bench t3` and `lethe bench engine`: decoding speed, with and without a head."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.common import UsageError, _add_model_args, _add_profile_args, _profile, _with_asu


def register(bench: argparse._SubParsersAction) -> None:
    """`lethe bench t3` and `engine`."""
    p = bench.add_parser("t3", help="T3 decoding overhead, speed against model.generate, training time")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=41, help="rounds: one run of each variant per round")
    p.add_argument("--random-model", metavar="HIDDEN,LAYERS", nargs="+", type=_model_size,
                   help="decode with randomly initialised Llamas of these sizes (same tokenizer) instead, one after "
                        "the other: how the head's fixed per-step cost compares with models of each size")
    p.add_argument("--out", type=Path, help="JSON results")
    p.set_defaults(func=cmd_bench_t3)

    p = bench.add_parser("engine", help="decode speed against model.generate and llama.cpp, with and without a head")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", type=Path, required=True, help="records whose questions are the prompts (and the "
                                                                 "head's training set without --head)")
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--gguf", type=Path, default=None, help="the model's GGUF file, for llama.cpp (needs "
                                                           "llama-cpp-python: `make llamacpp`; default: --model if "
                                                           "it is one)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="rounds: one run of each variant per round")
    p.add_argument("--equality", type=int, default=48, help="prompts whose greedy answers are compared")
    p.add_argument("--out", type=Path, help="JSON results")
    p.set_defaults(func=cmd_bench_engine)


def cmd_bench_t3(args) -> int:
    from lethe.server.bench.t3 import bench_t3
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl
    from lethe.heads.t3.pipeline import train_head

    lm = load_model(args.model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    head, settings = _profile(args, lm)
    if head is None and not args.random_model:
        head, _ = train_head(lm, forget, retain, progress=False)
    if args.random_model:
        from lethe.server.bench.t3 import random_model

        result = {"models": []}
        for hidden, layers in args.random_model:
            sized, random_head = random_model(lm, hidden, layers)
            n = sum(p.numel() for p in sized.model.parameters())
            print(f"random Llama, hidden {hidden}, {layers} layers: {n / 1e6:.1f}M parameters, random head")
            run = bench_t3(sized, forget, retain, random_head, repeats=args.repeats, training=False, settings=settings)
            _print_bench_decode(run["decode"])
            result["models"].append({"hidden": hidden, "layers": layers, "parameters": n, **run})
    else:
        asu_model = None
        if args.asu:  # decode the same base with the adapter attached (a copy, so the no-adapter runs stay plain)
            import copy

            from lethe.heads.asu.weights import attach, load_asu

            tensors, info = load_asu(args.asu, lm.fingerprint)
            asu_model = attach(copy.deepcopy(lm.model), "asu_bench", tensors, info)
        result = bench_t3(lm, forget, retain, head, repeats=args.repeats, asu_model=asu_model, settings=settings)
        _print_bench_decode(result["decode"])
    t = result.get("training")
    if t:
        print(f"training on {t['records']} records: Lethe cache {t['cache_s']:.2f} s + fit {t['fit_s']:.2f} s "
              f"= {t['lethe_total_s']:.2f} s; one reference epoch {t['reference_epoch_s']:.2f} s, "
              f"100 epochs {t['reference_100_epochs_s']:.0f} s ({t['reference_over_lethe']:.0f}x Lethe)")
    if args.out:
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=2))
    return 0


def _model_size(text: str) -> tuple[int, int]:
    """`HIDDEN,LAYERS` for `bench t3 --random-model`: two positive integers, hidden a multiple of 64 or below it."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected HIDDEN,LAYERS (two positive integers, e.g. 1024,8), got {text!r}")
    hidden, layers = (int(p) for p in parts)
    if hidden > 64 and hidden % 64:
        raise argparse.ArgumentTypeError(f"HIDDEN must be a multiple of 64 above 64 (heads of 64), got {hidden}")
    return hidden, layers


def _print_bench_decode(rows: list[dict]) -> None:
    for row in rows:
        print(f"decode batch {row['batch']}: T3 / no head = {row['t3_over_no_head']:.3f}x "
              f"(+{row['t3_ms_per_token']:.3f} ms per step of {row['no_head_ms_per_token']:.3f} ms; "
              f"as tensor operations {row['t3_tensor_ops_over_no_head']:.3f}x; "
              f"control, a pass-through guide: {row['passthrough_guide_over_no_head']:.3f}x), "
              f"Lethe speed / model.generate = {row['lethe_speedup_over_hf_generate']:.3f}x "
              f"(no head {row['no_head_s']:.3f} s, T3 {row['t3_s']:.3f} s, generate {row['hf_generate_s']:.3f} s, "
              f"{row['new_tokens']} tokens)")
        if "asu_over_no_head" in row:
            print(f"decode batch {row['batch']}: ASU / no adapter = {row['asu_over_no_head']:.3f}x, "
                  f"ASU + T3 = {row['asu_t3_over_no_head']:.3f}x, "
                  f"ASU + T3 routed by the probe = {row['asu_t3_routed_over_no_head']:.3f}x "
                  f"({row['asu_t3_routed_adapter_rows']}/{row['batch']} rows on the adapter), "
                  f"half ASU rows, half base rows = {row['asu_mixed_with_base_over_no_head']:.3f}x, "
                  f"base rows on the adapted model = {row['asu_model_base_rows_over_no_head']:.3f}x, "
                  f"ASU unmerged (the release before) = {row['asu_unmerged_over_no_head']:.3f}x, "
                  f"ASU with per-row routing = {row['asu_per_row_routing_over_no_head']:.3f}x")


def cmd_bench_engine(args) -> int:
    from lethe.server.bench.engine import bench_engine
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import ask, read_jsonl, resolve_format
    from lethe.heads.t3.pipeline import train_head

    gguf = args.gguf or (args.model if str(args.model).endswith(".gguf") else None)
    if gguf is not None:  # a GGUF file is benched on llama.cpp: without llama-cpp-python, fail now, in one line
        from lethe.heads.decoding.llamacpp import _library

        _library()
    lm = load_model(args.model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    head, settings = _profile(args, lm)
    if head is None:
        print("bench engine: training a head on --forget / --retain", file=sys.stderr, flush=True)
        head, _ = train_head(lm, forget, retain, progress=False)
    records = forget + retain
    step = max(1, len(records) // max(args.equality, 8))
    fmt = resolve_format(lm.tokenizer)
    prompts = [ask(r["question"], fmt, lm.tokenizer) for r in records[::step]][:max(args.equality, 8)]
    decoder = None
    if gguf is not None:
        from lethe.heads.decoding.llamacpp import open_gguf

        decoder = open_gguf(lm, gguf, 8, None)
    elif args.asu:
        raise UsageError("bench engine: --asu is timed on the llama.cpp engine; give the model's GGUF file (--gguf)")
    _with_asu(args, lm, decoder)  # an --asu adapter goes into llama.cpp as `asu_cli`
    result = bench_engine(lm, head, settings, prompts, new_tokens=args.new_tokens, repeats=args.repeats, gguf=gguf,
                          equality=args.equality, log=lambda m: print(m, file=sys.stderr, flush=True),
                          decoder=decoder, asu="asu_cli" if args.asu else None)
    text = json.dumps(result, indent=1)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0
