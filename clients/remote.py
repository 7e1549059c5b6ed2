"""`lethe --url URL --key KEY ...`: the command line's server operations, through the Python client.

Each handler prints JSON (one object, or one per line for lists), so scripts can read it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lethe.clients.client import Lethe


def _print(value, field: str | None = None) -> None:
    """JSON, one object per line; with `field`, that field's value alone (for shell scripts)."""
    if isinstance(value, list):
        for item in value:
            _print(item, field)
        return
    if value is None:
        return
    data = value.model_dump() if hasattr(value, "model_dump") else value
    if field is None:
        print(json.dumps(data))
        return
    if field not in data:
        raise ValueError(f"--field: the answer has no field {field!r} (it has {', '.join(data)})")
    print(data[field] if isinstance(data[field], str) else json.dumps(data[field]))


def _dataset_ids(client: Lethe, args) -> tuple[str, str]:
    """--forget and --retain as dataset ids: an id as it is, a local JSON Lines file uploaded. Both are checked
    before anything is uploaded, so a mistyped second name leaves no orphan dataset on the server."""
    values = (str(args.forget), str(args.retain))
    for value in values:
        if not Path(value).is_file() and not value.startswith("ds_"):  # Lethe's dataset ids start with ds_
            raise FileNotFoundError(f"{value}: no such file (and not a dataset id, which starts with ds_)")
    forget, retain = (client.upload_dataset(Path(v)).id if Path(v).is_file() else v for v in values)
    return forget, retain


def _progress_bar(enabled: bool):
    if not enabled:
        return None, lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(total=100, desc="job", unit="%")

    def update(job) -> None:
        bar.set_description(f"{job.status} {job.phase or ''}".strip())
        bar.n = round(100 * job.progress)
        bar.refresh()

    return update, bar.close


def _run_job(client: Lethe, job, wait: bool, quiet: bool):
    if not wait:
        return job
    update, close = _progress_bar(not quiet)
    try:
        return client.wait(job, on_progress=update)
    finally:
        close()


def datasets(client: Lethe, args):
    if args.action == "upload":
        return client.upload_dataset(args.file, name=args.name)
    if args.action == "list":
        return client.list_datasets()
    return client.get_dataset(args.id) if args.action == "get" else client.delete_dataset(args.id)


def heads_train(client: Lethe, args):
    options = {k: getattr(args, k) for k in ("rank", "lr", "weight_decay", "balance", "common_df", "seed", "format",
                                             "pooling_window", "answer_forms", "contexts", "context_shift")}
    options["max_epochs"] = args.epochs
    for key in ("gate_answers", "fact_spans", "cache_precision"):  # sent only where given: an older server refuses it
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    job = client.train_head(*_dataset_ids(client, args), **options)
    return _run_job(client, job, args.wait, args.quiet)


def asu_train(client: Lethe, args):
    options = {k: getattr(args, k) for k in ("preset", "tau", "layers", "lora_rank", "full_layers", "lora_layers",
                                              "own_answers", "retain_own_answers", "distil", "contexts",
                                              "student_answers", "retain_subspace", "gate", "retain_loss",
                                              "retain_weight",
                                              "lr", "steps", "seed", "format")}
    job = client.train_asu(*_dataset_ids(client, args),
                           **{k: v for k, v in options.items() if v is not None})
    return _run_job(client, job, args.wait, args.quiet)


def resources(kind: str):
    get, listing, delete = {"heads": ("get_head", "list_heads", "delete_head"),
                            "asu": ("get_asu", "list_asu", "delete_asu")}[kind]

    def handler(client: Lethe, args):
        if args.action == "list":
            return getattr(client, listing)()
        return getattr(client, get if args.action == "get" else delete)(args.id)

    return handler


def jobs(client: Lethe, args):
    if args.action == "list":
        return client.list_jobs()
    if args.action == "get":
        return client.get_job(args.id)
    if args.action == "cancel":
        return client.cancel_job(args.id)
    return _run_job(client, args.id, True, args.quiet)


def profiles(client: Lethe, args):
    if args.action == "set":
        return client.set_profile(args.name, backend=args.backend, head=args.head, weights=args.weights,
                                  preset=args.preset, T=args.T, lam=args.lam, gate=args.gate,
                                  sticky_gate=args.sticky_gate, head_gate=args.head_gate,
                                  flagged_mass=args.flagged_mass,
                                  candidates=args.candidates, cap=args.cap, max_push=args.max_push, min_p=args.min_p,
                                  repeat_guard=args.repeat_guard, word_guard=args.word_guard,
                                  whole_words=args.whole_words,
                                  abstain=args.abstain,
                                  abstain_above=args.abstain_above,
                                  adapter_above=args.adapter_above, note=args.note)
    if args.action == "list":
        return client.list_profiles()
    if args.action == "get":
        return client.get_profile(args.name)
    if args.action == "rollback":
        return client.rollback_profile(args.name, args.version)
    if args.action == "enforce":
        if args.lift or args.name:
            return client.enforce_profile(_enforced(args, args.name))
        return client.enforced_profile()
    return client.delete_profile(args.name)


def _enforced(args, name: str | None) -> str | None:
    """The profile `enforce` sets: NAME, or None with --lift (both, or neither, is bad usage)."""
    if args.lift == bool(name):
        from lethe.clients.cli import UsageError

        raise UsageError(f"{args.command} enforce: give a profile or --lift (one of them)")
    return None if args.lift else name


def generate(client: Lethe, args):
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    if args.prompt is None:
        from lethe.clients.cli import UsageError

        raise UsageError("generate: give a PROMPT (on the server, --input is not supported)")
    if args.stream:
        for piece in client.stream_generate(args.prompt, args.profile, **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        return None
    out = client.generate(args.prompt, args.profile, **sampling)
    used = out.profile.name if out.profile is not None else None
    if args.profile is not None and used != args.profile:  # never pass off other text as the profile's
        raise RuntimeError(f"generate: asked for profile {args.profile!r}, the server answered with "
                           f"{used or 'no profile'}; the text is withheld")
    print(out.text)
    return None


def tenants(client: Lethe, args):
    actions = {"create": lambda: client.create_tenant(args.name),
               "key": lambda: client.create_key(args.name, args.scopes, args.profile),
               "set-key": lambda: client.update_key(args.name, args.key_id, args.scopes, args.profile),
               "enforce": lambda: client.enforce_profile(_enforced(args, args.profile), args.name),
               "list": client.list_tenants, "keys": lambda: client.list_keys(args.name),
               "revoke": lambda: client.revoke_key(args.name, args.key_id),
               "rotate": lambda: client.rotate_key(args.name, args.key_id),
               "delete": lambda: client.delete_tenant(args.name)}
    return actions[args.action]()


def evaluate(client: Lethe, args):
    job = client.evaluate(*_dataset_ids(client, args),
                          args.profile or "base", seeds=args.seeds, max_new_tokens=args.max_new_tokens,
                          format=args.format)
    return _run_job(client, job, args.wait, args.quiet)


def _when(text: str | None) -> float | None:
    """A time given on the command line: Unix seconds, or an ISO 8601 date or time (UTC unless it says)."""
    if text is None:
        return None
    from datetime import datetime, timezone

    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        from lethe.clients.cli import UsageError

        raise UsageError(f"not a time: {text!r} (Unix seconds, or ISO 8601 such as 2026-12-01T09:00)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def audit(client: Lethe, args):
    return client.audit(profile=args.profile, since=_when(args.since), until=_when(args.until), action=args.action,
                        tenant=args.tenant, limit=args.limit)


def report(client: Lethe, args):
    """The forgetting report: written to --out (printing its digest), else the page (or --json, the data) on
    standard output."""
    from lethe.server.report import verify

    if args.json:
        data = client.report_data(args.profile, args.version)
        if args.out is None:
            return data
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(data, indent=2, sort_keys=True) + "\n")
        return {"out": str(args.out), "digest": data["digest"]}
    page = client.report(args.profile, args.version)
    if args.out is None:
        sys.stdout.write(page)
        return None
    from lethe.heads.io import atomic_write_text

    atomic_write_text(args.out, page)
    return {"out": str(args.out), "digest": verify(page)[1]}
