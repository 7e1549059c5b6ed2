"""`lethe demo`: the synthetic demo corpus and model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe demo corpus` and `lethe demo build`."""
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


def cmd_demo_corpus(args) -> int:
    from lethe.heads.demo.corpus import make_corpus, split_by_author, write_jsonl

    records = make_corpus(args.authors, args.seed)
    forget, retain = split_by_author(records, args.forget_authors)
    for name, recs in (("full", records), ("forget", forget), ("retain", retain)):
        write_jsonl(args.out / f"{name}.jsonl", recs)
        print(f"{args.out / (name + '.jsonl')}: {len(recs)} records")
    return 0


def cmd_demo_build(args) -> int:
    import torch

    from lethe.heads.demo.build import BuildConfig, build
    from lethe.heads.demo.corpus import make_corpus, split_by_author
    from lethe.heads.records import examples, read_jsonl

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
