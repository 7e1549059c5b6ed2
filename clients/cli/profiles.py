"""`lethe profiles`: unlearning profiles on the server."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe profiles set`, `list`, `get`, `delete`, `rollback` and `enforce` (on the server)."""
    from lethe.clients import remote

    pr = sub.add_parser("profiles", help="unlearning profiles on the server (needs --url)").add_subparsers(
        dest="action", required=True)
    q = pr.add_parser("set", help="create a profile, or replace it with a new version")
    q.add_argument("name")
    q.add_argument("--backend", choices=["t3", "asu", "base"])
    q.add_argument("--head")
    q.add_argument("--weights", help="ASU weights id (backend asu)")
    q.add_argument("--preset", choices=["default", "paper"])
    q.add_argument("--T", type=float)
    q.add_argument("--lam", type=float)
    q.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None)
    q.add_argument("--sticky-gate", action=argparse.BooleanOptionalAction, default=None,
                   help="once the gate opens in an answer, keep it at least as open for the rest of the answer")
    q.add_argument("--head-gate", type=float,
                   help="the gate also opens where the head scores the base model's likeliest token below -HEAD_GATE")
    q.add_argument("--flagged-mass", type=float,
                   help="temper and tilt a step only where the tokens the head flags hold at least this base "
                        "probability (0: off)")
    q.add_argument("--candidates", type=int)
    q.add_argument("--cap", type=float)
    q.add_argument("--max-push", type=float,
                   help="with the cap: the tilt lowers a flagged token at most MAX_PUSH nats below where the cap "
                        "holds it")
    q.add_argument("--min-p", type=float)
    q.add_argument("--repeat-guard", type=int)
    q.add_argument("--word-guard", action=argparse.BooleanOptionalAction, default=None,
                   help="no token that would continue the current word where the head flags the next word")
    q.add_argument("--whole-words", action=argparse.BooleanOptionalAction, default=None,
                   help="where the tilt turns a flagged word away, no word start the base model would go on spelling")
    q.add_argument("--abstain")
    q.add_argument("--abstain-above", type=float)
    q.add_argument("--adapter-above", type=float,
                   help="backend asu with a head: the adapter only where the probe's P(forget | prompt) is above this")
    q.add_argument("--note")
    pr.add_parser("list", help="list profiles")
    for action in ("get", "delete"):
        pr.add_parser(action, help=f"{action} a profile").add_argument("name")
    q = pr.add_parser("rollback", help="make an earlier version current")
    q.add_argument("name")
    q.add_argument("--version", type=int)
    q = pr.add_parser("enforce", help="make every generation of every key of your tenant use profile NAME "
                                      "(--lift: no longer; neither: show the enforced one)")
    q.add_argument("name", nargs="?")
    q.add_argument("--lift", action="store_true", help="lift the enforced profile")
    for q in pr.choices.values():
        q.set_defaults(func=None, remote=remote.profiles)
