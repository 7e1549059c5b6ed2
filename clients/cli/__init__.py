"""The `lethe` command line.

Exit codes: 0 success, 1 the command failed (the message says why), 2 bad usage.

One module a command group, each with `register(sub)`, which adds the group's parser (its options, its
subcommands) to the subparsers `sub`, and the functions that run its commands (`set_defaults(func=...)`; `remote=...`
where the command also, or only, runs on a server: a handler in `lethe.clients.remote`). `COMMAND_GROUPS` names them
in the order `lethe --help` lists them. A new command: a module here with `register`, its name in `COMMAND_GROUPS`.
What several groups share is in `common`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lethe.clients.cli.common import UsageError

__all__ = ["COMMAND_GROUPS", "UsageError", "build_parser", "main"]

COMMAND_GROUPS = ("serve", "models", "demo", "generate", "heads", "asu", "openapi", "datasets", "jobs", "profiles",
                  "tenants", "audit", "report", "eval", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lethe", description="Lethe: inference-time unlearning server.",
        epilog="Exit codes: 0 success; 1 the command failed (the server refused it, or a job failed); 2 bad usage; "
               "3 the server could not be reached.")
    parser.add_argument("--url", default=None,
                        help="a Lethe server: run server commands against it (default: $LETHE_URL); commands "
                             "that also run offline (generate, heads train, asu train, eval, bench soak) run on "
                             "the server when a URL is set, offline only without one or with their --local")
    parser.add_argument("--key", default=None, help="API key (default: $LETHE_KEY)")
    parser.add_argument("--field", help="on the server: print only this field of the answer (e.g. id, head)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_GROUPS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    _connection_options_everywhere(parser)
    return parser


def _connection_options_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--url`, `--key` and `--field` also after the subcommand (`lethe datasets list --url U`): every subcommand
    takes them too, and sets them only when given (SUPPRESS), so the top-level value stays otherwise."""
    actions = {a.dest: a for a in parser._actions if a.dest in ("url", "key", "field")}
    for sub in parser._subparsers._group_actions if parser._subparsers else []:
        for child in set(sub.choices.values()):
            own = {a.dest for a in child._actions}
            for dest, action in actions.items():
                if dest not in own:
                    child.add_argument(*action.option_strings, dest=dest, default=argparse.SUPPRESS, help=action.help)
            _connection_options_everywhere(child)


def _command(args) -> str:
    """The command's words, e.g. `heads train`."""
    sub = {"models": "models", "demo": "demo", "heads": "heads", "asu": "asu", "bench": "bench", "datasets": "action", "jobs": "action",
           "profiles": "action", "tenants": "action"}.get(args.command)
    return f"{args.command} {getattr(args, sub)}" if sub else args.command


def _given(args, table) -> list[str]:
    """The options of `table` (dest, flag, parser default) that the command line set."""
    return [flag for dest, flag, default in table if getattr(args, dest, default) != default]


def _check_mode(args, url_from: str | None) -> bool:
    """Decide where the command runs; True: on the server (args.url). Bad usage (never a silent fallback)
    when an option of the other mode was given. `url_from`: "--url", "$LETHE_URL" or None."""
    command = _command(args)
    modes = getattr(args, "_modes", None)
    has_remote = getattr(args, "remote", None) is not None
    if modes is None:
        if args.func is None:  # a server-only command
            if not args.url:
                raise UsageError(f"{command}: needs a server: give --url URL or set $LETHE_URL")
            return True
        if url_from == "--url":  # an offline-only command: a URL it cannot use is a mistake, not a hint
            raise UsageError(f"{command} runs offline only and does not use a server: drop --url")
        args.url = None
        return False
    offline_only, server_only = modes
    if args.local:
        if url_from == "--url":
            raise UsageError(f"{command}: --local runs offline, --url on a server: give one of them")
        args.url = None
    if args.url:
        wrong = _given(args, offline_only)
        if wrong:
            named = ", ".join(wrong)
            raise UsageError(
                f"{command}: {named} {'is' if len(wrong) == 1 else 'are'} for offline runs, but {url_from} is set "
                f"({args.url}), so this would run on the server and ignore {'it' if len(wrong) == 1 else 'them'}. "
                f"To run offline, on local files, add --local (or unset LETHE_URL); to use the server, drop {named}"
                + (" (the server's unlearning is chosen with --profile NAME; see `lethe profiles set`)"
                   if args.command in ("generate", "eval") else "") + ".")
        return has_remote
    wrong = _given(args, server_only)
    if wrong:
        named = ", ".join(wrong)
        why = "--local was given" if args.local else "no --url is given and $LETHE_URL is not set"
        raise UsageError(f"{command}: {named} {'needs' if len(wrong) == 1 else 'need'} a server, but {why}. "
                         f"Give --url URL (or set $LETHE_URL) without --local, or drop {named} to run offline.")
    return False


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not complain about the closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no real file (a test's capture): nothing to flush
        pass


def main(argv: list[str] | None = None) -> int:
    import os

    import httpx

    from lethe.clients.client import Lethe, LetheConnectionError, LetheError
    from lethe.clients.remote import _print
    from lethe.heads.modelio import ModelLoadError
    from lethe.heads.records import RecordError

    args = build_parser().parse_args(argv)
    env_url = os.environ.get("LETHE_URL") or None
    url_from = "--url" if args.url else "$LETHE_URL" if env_url else None
    args.url = args.url or env_url
    if args.key is None:
        args.key = os.environ.get("LETHE_KEY") or None
    try:
        on_server = _check_mode(args, url_from)
        if on_server and getattr(args, "remote", None) is not None:
            with Lethe(args.url, key=args.key) as client:
                _print(args.remote(client, args), args.field)
            return 0
        if args.field is not None:
            raise UsageError(f"{_command(args)}: --field selects a field of a server's answer, and this command "
                             "runs offline: drop --field")
        for dest, value in (getattr(args, "_offline_defaults", None) or {}).items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
        return args.func(args)
    except UsageError as e:
        print(f"lethe: error: {e}", file=sys.stderr)
        return 2
    except LetheConnectionError as e:
        print(f"lethe: error: {e.message}", file=sys.stderr)
        return 3
    except LetheError as e:
        print(f"lethe: error: {e}", file=sys.stderr)
        return 1
    except httpx.TransportError as e:  # httpx used directly (the bench and job helpers)
        print(f"lethe: error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # the reader went away (`lethe ... | head`): stop quietly, as other tools do
        _quiet_stdout()
        return 0
    except (ModelLoadError, RecordError, FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        print(f"lethe: error: {e}", file=sys.stderr)
        return 1
