"""`lethe report`: a profile version's forgetting report from the server; `lethe verify-report`: check one offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe report` (on the server) and `lethe verify-report` (offline)."""
    from lethe.clients import remote

    p = sub.add_parser("report", help="the forgetting report of a profile version: what was forgotten (datasets "
                                      "by sha256), the head or weights, when it served, its evaluations, a digest "
                                      "(needs --url)")
    p.add_argument("profile")
    p.add_argument("--version", type=int, default=None, help="default: the current one")
    p.add_argument("--out", type=Path, default=None, help="write it here (default: standard output)")
    p.add_argument("--json", action="store_true", help="the report's data (JSON) instead of the HTML page")
    p.set_defaults(func=None, remote=remote.report)
    p = sub.add_parser("verify-report", help="check that a saved report page is unchanged: its embedded data has "
                                             "the digest it shows")
    p.add_argument("file", type=Path)
    p.set_defaults(func=cmd_verify_report)


def cmd_verify_report(args) -> int:
    from lethe.server.report import verify

    ok, digest = verify(args.file.read_text(encoding="utf-8"))
    print(json.dumps({"file": str(args.file), "digest": digest, "verified": ok}))
    return 0 if ok else 1
