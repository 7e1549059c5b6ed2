"""`lethe datasets`: datasets on the server."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe datasets upload`, `list`, `get` and `delete` (on the server)."""
    from lethe.clients import remote

    ds = sub.add_parser("datasets", help="datasets on the server (needs --url)").add_subparsers(dest="action",
                                                                                             required=True)
    q = ds.add_parser("upload", help="upload a JSON Lines file")
    q.add_argument("file", type=Path)
    q.add_argument("--name")
    ds.add_parser("list", help="list datasets")
    for action in ("get", "delete"):
        ds.add_parser(action, help=f"{action} a dataset").add_argument("id")
    for q in ds.choices.values():
        q.set_defaults(func=None, remote=remote.datasets)
