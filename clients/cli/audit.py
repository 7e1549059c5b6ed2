"""`lethe audit`: the audit trail on the server (a tenant's `manage` key: its own; the admin key: every tenant's)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe audit` (on the server)."""
    from lethe.clients import remote

    p = sub.add_parser("audit", help="the audit trail: every change to keys, profiles, the enforced profile, heads, "
                                     "ASU weights and datasets, with the acting key (needs --url)")
    p.add_argument("--profile", help="only this profile's entries")
    p.add_argument("--since", help="entries at or after this time (Unix seconds or ISO 8601, UTC unless it says)")
    p.add_argument("--until", help="entries at or before this time")
    p.add_argument("--action", help="only this action, e.g. profile.set")
    p.add_argument("--tenant", help="admin key: only this tenant's entries")
    p.add_argument("--limit", type=int, default=None, help="at most this many (default 1000)")
    p.set_defaults(func=None, remote=remote.audit)
