"""The `lethe` command line.

Exit codes: 0 success, 1 the command failed (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser, default_demo: bool = True) -> None:
    from server.settings import DEMO_MODEL

    p.add_argument("--model", type=Path, default=DEMO_MODEL if default_demo else None,
                   help="local Hugging Face causal-LM directory (default: the embedded demo model)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")


def cmd_serve(args) -> int:
    import uvicorn

    from server.app import create_app
    from server.settings import Settings

    overrides = {k: v for k, v in {"model": args.model, "host": args.host, "port": args.port,
                                   "device": args.device, "dtype": args.dtype}.items() if v is not None}
    settings = Settings(**overrides)
    from heads.modelio import load_model

    lm = load_model(settings.model, settings.device, settings.dtype)
    print(f"lethe: serving {settings.model} on http://{settings.host}:{settings.port}", flush=True)
    uvicorn.run(create_app(settings, lm), host=settings.host, port=settings.port, log_level="info")
    return 0


def cmd_demo_corpus(args) -> int:
    from heads.demo.corpus import make_corpus, split_by_author, write_jsonl

    records = make_corpus(args.authors, args.seed)
    forget, retain = split_by_author(records, args.forget_authors)
    for name, recs in (("full", records), ("forget", forget), ("retain", retain)):
        write_jsonl(args.out / f"{name}.jsonl", recs)
        print(f"{args.out / (name + '.jsonl')}: {len(recs)} records")
    return 0


def cmd_demo_build(args) -> int:
    import torch

    from heads.demo.build import BuildConfig, build
    from heads.demo.corpus import make_corpus, split_by_author
    from heads.records import examples, read_jsonl

    records = read_jsonl(args.data) if args.data else make_corpus(args.authors, args.seed)
    if args.exclude_authors:
        if not all("author" in r for r in records):
            print("lethe: --exclude-authors needs an `author` field on every record", file=sys.stderr)
            return 2
        records = split_by_author(records, args.exclude_authors)[1]
    cfg = BuildConfig(hidden_size=args.hidden_size, layers=args.layers, heads=args.heads,
                      intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                      lr=args.lr, batch_size=args.batch_size, max_epochs=args.max_epochs, target_recall=args.target_recall, seed=args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = build(examples(records), args.out, cfg, progress=not args.quiet)
    print(json.dumps({"out": str(args.out), **report.__dict__}))
    return 0


def cmd_generate(args) -> int:
    from heads.decode import generate_chunked
    from heads.modelio import load_model
    from heads.sampling import SamplingParams

    lm = load_model(args.model, args.device, args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.input:
        from heads.records import read_jsonl

        prompts = [r["prompt"] for r in read_jsonl(args.input, prompts_only=True)]
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        print("lethe generate: give a PROMPT or --input PROMPTS.jsonl", file=sys.stderr)
        return 2
    outs = generate_chunked(lm.model, lm.tokenizer, prompts, params)
    if args.output:
        from heads.io import atomic_write_text

        atomic_write_text(args.output, "".join(json.dumps({"prompt": p, "text": o.text}) + "\n"
                                               for p, o in zip(prompts, outs)))
    else:
        for o in outs:
            print(o.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lethe", description="Lethe: inference-time unlearning server.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the HTTP server")
    p.add_argument("--model", type=Path, default=None, help="local Hugging Face causal-LM directory "
                   "(default: $LETHE_MODEL or the embedded demo model)")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="the synthetic demo corpus and model").add_subparsers(dest="demo",
                                                                                             required=True)
    p = demo.add_parser("corpus", help="write the synthetic corpus (full, forget, retain)")
    p.add_argument("--authors", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forget-authors", type=int, default=4, help="the first K authors form the forget set")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_demo_corpus)

    p = demo.add_parser("build", help="train a tokenizer and a small Llama that memorises QA records")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", type=Path, help="QA JSON Lines with TOFU field names (question, answer)")
    src.add_argument("--authors", type=int, default=40, help="synthetic authors to generate (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude-authors", type=int, default=0, help="leave out the first K authors (a retain twin)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-epochs", type=int, default=60)
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo_build)

    p = sub.add_parser("generate", help="generate offline, without a server")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt")
    p.add_argument("--input", type=Path, help="JSON Lines, one {\"prompt\": ...} per line")
    p.add_argument("--output", type=Path, help="JSON Lines out, one {\"prompt\", \"text\"} per line")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from heads.modelio import ModelLoadError
    from heads.records import RecordError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, RecordError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"lethe: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
