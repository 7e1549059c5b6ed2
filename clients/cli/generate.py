"""`lethe generate`: on the server, or offline on a local model with head and adapter files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.common import (_PROFILE_DESTS, _add_engine_args, _add_model_args,
                                      _add_profile_args, _engine_model, _modes, _profile, _with_asu)


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe generate`."""
    from lethe.clients import remote

    p = sub.add_parser("generate", help="generate on the server (--url or $LETHE_URL), else (or with --local) offline",
                       description="On the server when --url or $LETHE_URL is set, with --profile; otherwise (or "
                                   "with --local) offline on --model, with --head and/or --asu files. Options of "
                                   "the other mode are refused, never ignored.")
    _add_model_args(p)
    _add_sampling_args(p)
    _add_profile_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt")
    p.add_argument("--input", type=Path, help="JSON Lines, one {\"prompt\": ...} per line")
    p.add_argument("--output", type=Path, help="JSON Lines out, one {\"prompt\", \"text\"} per line")
    p.add_argument("--profile", help="on the server: the profile to generate with (default: base)")
    p.add_argument("--stream", action="store_true", help="on the server: print the text as it comes")
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate, remote=remote.generate)
    _modes(p, offline=["model", "device", "dtype", *_PROFILE_DESTS, "input", "output", "engine", "gguf"],
           server=["profile", "stream"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")


def cmd_generate(args) -> int:
    from lethe.heads.decoding.decode import generate_chunked
    from lethe.heads.t3.guide import HeadGuide
    from lethe.heads.modelio import load_model
    from lethe.heads.decoding.sampling import SamplingParams

    lm = load_model(args.model, args.device, args.dtype)
    head, settings = _profile(args, lm)
    fast = _engine_model(args, lm, 16)
    lm = _with_asu(args, lm, fast)
    guide = HeadGuide.uniform(head, settings) if head is not None else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.input:
        from lethe.heads.records import read_jsonl

        prompts = [r["prompt"] for r in read_jsonl(args.input, prompts_only=True)]
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        print("lethe generate: give a PROMPT or --input PROMPTS.jsonl", file=sys.stderr)
        return 2
    outs = generate_chunked(fast or lm.model, lm.tokenizer, prompts, params, batch_size=16 if fast else 64,
                            guide=guide, adapter="asu_cli" if args.asu else None,
                            repeat_guard=getattr(args, "asu_repeat_guard", 0) if guide is None else 0)
    if args.output:
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.output, "".join(json.dumps({"prompt": p, "text": o.text}) + "\n"
                                               for p, o in zip(prompts, outs)))
    else:
        for o in outs:
            print(o.text)
    return 0
