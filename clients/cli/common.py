"""What several command groups share: the offline/server modes of a command, the model, engine and head-profile
options, and reading them back."""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(ValueError):
    """Bad usage that argparse could not catch: exit code 2."""


def _offline_defaults(p: argparse.ArgumentParser, **values) -> None:
    """Defaults applied only when the command runs offline. The parser's own default stays None, so that an
    option given on the command line can be told from one left out (see `_modes`)."""
    p.set_defaults(_offline_defaults={**(p.get_default("_offline_defaults") or {}), **values})


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from lethe.server.settings import DEMO_MODEL

    p.add_argument("--model", type=Path, default=None,
                   help="local Hugging Face causal-LM directory (offline; default: the embedded demo model)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (offline; default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="offline; default float32")
    _offline_defaults(p, model=DEMO_MODEL, device="cpu", dtype="float32")


def _add_format_arg(p: argparse.ArgumentParser) -> None:
    """`--format`: how the training and evaluation commands put question/answer records to the model."""
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"],
                   help="question/answer records as the model's chat template (chat, as /v1/chat/completions asks), "
                        "Question: ... Answer: (qa), or the question alone (raw); auto: chat where the model has a "
                        "template, else qa")


def _modes(p: argparse.ArgumentParser, offline: list[str], server: list[str]) -> None:
    """Mark `p` as a command that runs offline or on a server: on the server when a URL is set (--url or
    $LETHE_URL) unless --local is given. `offline` and `server` name (by dest) the options that only one side
    uses; giving one on the other side is bad usage, never silently ignored (see `_check_mode`)."""
    p.add_argument("--local", action="store_true",
                   help="run offline, on local files, even though $LETHE_URL is set")
    actions = {a.dest: a for a in p._actions}

    def table(dests):
        return [(d, "/".join(actions[d].option_strings) or d, actions[d].default) for d in dests]

    p.set_defaults(_modes=(table(offline), table(server)))


def _engine_model(args, lm, rows: int):
    """What decodes offline: the llama.cpp model for --engine llamacpp (`heads.decoding.llamacpp`), else None."""
    if args.engine != "llamacpp":
        if args.gguf is not None:
            raise UsageError("--gguf names the file the llama.cpp engine decodes: add --engine llamacpp")
        return None
    from lethe.heads.decoding.llamacpp import open_gguf

    return open_gguf(lm, args.gguf, rows, None)


def _add_engine_args(p: argparse.ArgumentParser, default: str | None = "torch") -> None:
    p.add_argument("--engine", default=default, choices=["torch", "llamacpp"],
                   help="what decodes: torch (default; transformers) or llamacpp (llama.cpp on the GGUF file, "
                        "several times faster on a CPU; needs `make llamacpp`)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="with --engine llamacpp: the GGUF file (default: --model, when it is one)")


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", type=Path, help="a T3 head file (from `lethe heads train` or `import-reference`)")
    p.add_argument("--preset", choices=["default", "paper"], help="named settings (default: the head's own)")
    p.add_argument("--T", type=float, help="tempering temperature T > 0")
    p.add_argument("--lam", type=float, help="tilt strength lambda >= 0")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None,
                   help="temper and tilt only as far as the context is forget-like")
    p.add_argument("--sticky-gate", action=argparse.BooleanOptionalAction, default=None,
                   help="once the gate opens in an answer, keep it at least as open for the rest of the answer")
    p.add_argument("--head-gate", type=float, help="the gate also opens where the head scores the base model's "
                                                   "likeliest token below -HEAD_GATE (0: off; default without "
                                                   "--preset: the head's calibrated recommendation)")
    p.add_argument("--flagged-mass", type=float, help="temper and tilt a step only where the tokens the head flags "
                                                      "hold at least this base probability (0: off)")
    p.add_argument("--candidates", type=int, help="tilt among the base model's k likeliest tokens (0: all)")
    p.add_argument("--cap", type=float, help="flagged tokens score at most the best other token minus CAP")
    p.add_argument("--no-cap", action="store_true", help="turn the spike cap off")
    p.add_argument("--max-push", type=float, help="with the cap: the tilt lowers a flagged token at most MAX_PUSH "
                                                  "nats below where the cap holds it (100: no limit in practice)")
    p.add_argument("--min-p", type=float, help="forget-like contexts: drop candidates below MIN_P x the best's "
                                               "probability (0: off)")
    p.add_argument("--repeat-guard", type=int, help="forget-like contexts: no word that repeats a word n-gram of "
                                                    "the answer, for this n (0: off); with --asu and no head, the "
                                                    "adapter's rows' own guard (default 0; 3 for gated weights)")
    p.add_argument("--word-guard", action=argparse.BooleanOptionalAction, default=None,
                   help="forget-like contexts: where the head flags the likeliest token and it starts a word, no "
                        "token that would continue the current word instead")
    p.add_argument("--whole-words", action=argparse.BooleanOptionalAction, default=None,
                   help="forget-like contexts: where the tilt turns a flagged word away, no word start the base "
                        "model would go on spelling (a one-token lookahead)")
    p.add_argument("--abstain", help="reply with this text (e.g. \"I don't know.\") when the head's probe calls the "
                                     "prompt forget-like")
    p.add_argument("--abstain-above", type=float, help="the probe's P(forget | prompt) above which --abstain replies")
    p.add_argument("--adapter-above", type=float,
                   help="with --asu and --head: decode with the adapter only where the head's probe gives "
                        "P(forget | prompt) above this, else with the base weights (0: always)")
    p.add_argument("--asu", type=Path, help="ASU adapter weights (from `lethe asu train`), alone or with --head")


_PROFILE_DESTS = ["head", "preset", "T", "lam", "gate", "sticky_gate", "head_gate", "flagged_mass", "candidates",
                  "cap", "no_cap", "max_push", "min_p", "repeat_guard", "word_guard", "whole_words", "abstain",
                  "abstain_above", "adapter_above", "asu"]


def _profile(args, lm):
    """(head, settings) from the command line; settings default to the head's recommended ones."""
    from lethe.heads.t3.guide import PRESETS, TiltSettings
    from lethe.heads.t3.head import load_head

    given = {name: getattr(args, name) for name in TiltSettings.names()}  # every setting has its flag
    if args.head is None:
        if args.preset is not None or any(v is not None for v in given.values()):
            flags = ["--preset"] + ["--" + name.replace("_", "-") for name in given]
            raise ValueError(f"{', '.join(flags[:-1])} and {flags[-1]} need --head")
        return None, None
    head, info = load_head(args.head, lm.fingerprint, lm.model.config.vocab_size, lm.model.config.hidden_size)
    base = PRESETS[args.preset] if args.preset else TiltSettings.from_dict(info.profile)
    settings = base.replace(**given)
    return head, (settings.replace() if not args.no_cap else TiltSettings(**{**settings.as_dict(), "cap": None}))


def _with_asu(args, lm, decoder=None):
    """`lm` with the --asu adapter attached (in place, sharing the base weights), or as it is; with a llama.cpp
    `decoder`, `lm` as it is and the adapter loaded into `decoder` as `asu_cli` (rows must name it)."""
    if not getattr(args, "asu", None):
        return lm
    from dataclasses import replace

    from lethe.heads.asu.weights import attach, default_repeat_guard, load_asu

    tensors, info = load_asu(args.asu, lm.fingerprint)
    # rows of the weights alone get their own repeat guard, as a server's profile gives them
    guard = getattr(args, "repeat_guard", None)
    args.asu_repeat_guard = guard if guard is not None else default_repeat_guard(info)
    if decoder is not None:
        from lethe.heads.asu.gguf import add_to_llama_cpp

        add_to_llama_cpp(decoder, "asu_cli", tensors, info, lm.model.config)
        return lm
    return replace(lm, model=attach(lm.model, "asu_cli", tensors, info))


def _offline_inputs(args, command: str):
    """(model, forget records, retain records) for an offline training command that writes --out."""
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    if args.out is None:
        raise UsageError(f"{command}: --out is required offline")
    return load_model(args.model, args.device, args.dtype), read_jsonl(Path(args.forget)), read_jsonl(Path(args.retain))


def _add_resource_commands(group, kind: str, label: str) -> None:
    """`list`, `get ID` and `delete ID` for one kind of server resource (they need --url)."""
    from lethe.clients import remote

    for action in ("list", "get", "delete"):
        q = group.add_parser(action, help=f"{action} the server's {label} (needs --url)")
        if action != "list":
            q.add_argument("id")
        q.set_defaults(func=None, remote=remote.resources(kind), action=action)
