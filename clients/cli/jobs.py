"""`lethe jobs`: training jobs on the server."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe jobs list`, `get`, `cancel` and `wait` (on the server)."""
    from lethe.clients import remote

    jb = sub.add_parser("jobs", help="training jobs on the server (needs --url)").add_subparsers(dest="action",
                                                                                                required=True)
    jb.add_parser("list", help="list jobs")
    for action in ("get", "cancel", "wait"):
        q = jb.add_parser(action, help=f"{action} a job")
        q.add_argument("id")
        q.add_argument("--quiet", action="store_true", help="wait: no progress bar")
    for q in jb.choices.values():
        q.set_defaults(func=None, remote=remote.jobs, quiet=getattr(q, "quiet", False))
