"""`lethe tenants`: tenants and their keys on the server (the admin key's commands)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe tenants create`, `key`, `list`, `keys`, `revoke`, `rotate` and `delete` (on the server)."""
    from lethe.clients import remote

    tn = sub.add_parser("tenants", help="tenants and keys (needs --url and the admin key)").add_subparsers(
        dest="action", required=True)
    tn.add_parser("create", help="a tenant and its first key").add_argument("name")
    tn.add_parser("key", help="a further key for a tenant").add_argument("name")
    tn.add_parser("list", help="every tenant, with its number of keys")
    tn.add_parser("keys", help="a tenant's keys: id, first characters, created, last used").add_argument("name")
    for action, text in (("revoke", "revoke a key (401 from now on)"),
                         ("rotate", "a new key in place of KEY_ID (the old one stops working)")):
        q = tn.add_parser(action, help=text)
        q.add_argument("name")
        q.add_argument("key_id")
    tn.add_parser("delete", help="delete a tenant with all its data").add_argument("name")
    for q in tn.choices.values():
        q.set_defaults(func=None, remote=remote.tenants)
