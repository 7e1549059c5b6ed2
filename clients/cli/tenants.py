"""`lethe tenants`: tenants and their keys on the server (the admin key's commands)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe tenants create`, `key`, `set-key`, `list`, `keys`, `revoke`, `rotate`, `enforce` and `delete` (on the
    server)."""
    from lethe.clients import remote

    tn = sub.add_parser("tenants", help="tenants and keys (needs --url and the admin key)").add_subparsers(
        dest="action", required=True)
    tn.add_parser("create", help="a tenant and its first key").add_argument("name")
    q = tn.add_parser("key", help="a further key for a tenant: with --scope, only those rights; with --profile P, "
                                  "every generation through it uses profile P")
    q.add_argument("name")
    _key_terms(q)
    q = tn.add_parser("set-key", help="give a key new scopes and binding (as `key` makes them: no --scope is every "
                                      "scope, no --profile unbinds it)")
    q.add_argument("name")
    q.add_argument("key_id")
    _key_terms(q)
    q = tn.add_parser("enforce", help="make every generation of every key of a tenant use PROFILE (--lift: no "
                                      "longer)")
    q.add_argument("name")
    q.add_argument("profile", nargs="?")
    q.add_argument("--lift", action="store_true", help="lift the enforced profile")
    tn.add_parser("list", help="every tenant, with its number of keys")
    tn.add_parser("keys", help="a tenant's keys: id, first characters, created, last used, scopes, bound "
                               "profile").add_argument("name")
    for action, text in (("revoke", "revoke a key (401 from now on)"),
                         ("rotate", "a new key in place of KEY_ID (the old one stops working)")):
        q = tn.add_parser(action, help=text)
        q.add_argument("name")
        q.add_argument("key_id")
    tn.add_parser("delete", help="delete a tenant with all its data").add_argument("name")
    for q in tn.choices.values():
        q.set_defaults(func=None, remote=remote.tenants)


def _key_terms(q: argparse.ArgumentParser) -> None:
    q.add_argument("--scope", action="append", choices=["manage", "generate", "evaluate"], dest="scopes",
                   help="a right of the key; repeat for several (default: all three; with --profile: generate)")
    q.add_argument("--profile", help="bind the key to this profile: every generation through it uses it, whatever "
                                     "the request asks")
