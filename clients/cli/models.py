"""`lethe models`: models users have."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe models prepare`."""
    models = sub.add_parser("models", help="models users have: prepare a GGUF file once for fast starts"
                            ).add_subparsers(dest="models", required=True)
    p = models.add_parser("prepare", help="dequantise a GGUF file (llama.cpp, Ollama) into a Hugging Face directory",
                          description="Reads FILE with the `gguf` package (pip install 'lethe[gguf]'), writes a plain "
                                      "Hugging Face directory the server starts from in a second, and records the "
                                      "weights' fingerprint, so heads trained on either load on both.")
    p.add_argument("--gguf", type=Path, required=True, metavar="FILE")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="a directory that does not exist yet")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_models_prepare)


def cmd_models_prepare(args) -> int:
    from lethe.heads.modelio import prepare_gguf

    out = prepare_gguf(args.gguf, args.out, args.dtype)
    print(json.dumps({"prepared": str(out), "from": str(args.gguf), "dtype": args.dtype,
                      "fingerprint": json.loads((out / "lethe_model.json").read_text())["fingerprint"]}))
    return 0
