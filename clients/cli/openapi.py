"""`lethe openapi`: the HTTP API's schema."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe openapi`."""
    p = sub.add_parser("openapi", help="print the HTTP API's OpenAPI schema (or, --markdown, the README table)")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_openapi)


def cmd_openapi(args) -> int:
    from lethe.server.openapi_doc import main as render

    print(render(args.markdown), end="" if args.markdown else "\n")
    return 0
