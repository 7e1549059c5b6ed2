"""The `lethe` command line.

Exit codes: 0 success, 1 the command failed (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")


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
                        "several times faster on a CPU; pip install 'lethe[llamacpp]'; no ASU adapters)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="with --engine llamacpp: the GGUF file (default: --model, when it is one)")


def cmd_serve(args) -> int:
    import logging

    import uvicorn
    from pydantic import ValidationError

    from lethe.heads.modelio import load_model
    from lethe.server.app import create_app, use_chat_template
    from lethe.server.settings import Settings, read_config

    flags = {"model": args.model, "host": args.host, "port": args.port, "device": args.device, "dtype": args.dtype,
             "data_dir": args.data_dir, "max_batch_size": args.max_batch_size, "max_queue": args.max_queue,
             "max_model_len": args.max_model_len, "served_model_name": args.served_model_name,
             "chat_template": args.chat_template, "database_url": args.database_url, "blob_url": args.blob_url,
             "engine": args.engine, "gguf": args.gguf}
    # flags over the config file, the file over LETHE_* variables, those over the defaults
    values = (read_config(args.config) if args.config else {}) | {k: v for k, v in flags.items() if v is not None}
    try:
        settings = Settings(**values)
    except ValidationError as e:
        raise ValueError("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
                                   for err in e.errors())) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.blob_url:
        from lethe.server.blobs import check_blob_url

        check_blob_url(settings.blob_url)  # a store that cannot be used fails now, in one line
    if args.ray:
        return _serve_on_ray(settings, args)
    if args.replicas is not None or args.ray_address is not None:
        raise UsageError("--replicas and --ray-address need --ray")
    sock = _listen(settings.host, settings.port)  # first: a busy port fails before a model loads or a key is made
    _check_store(settings)
    checked = None
    if settings.engine == "llamacpp":
        from lethe.heads.decoding.llamacpp import gguf_for

        checked = gguf_for(settings.model, settings.gguf)  # the build and the file, before the model loads
    lm = load_model(settings.model, settings.device, settings.dtype)
    if settings.chat_template is not None:  # a template that does not render fails here, before any key is made
        use_chat_template(lm.tokenizer, settings.chat_template)
    decoder = None
    if checked is not None:  # opened here, so weights that are not the model's fail in one line
        from lethe.heads.decoding.llamacpp import open_gguf

        decoder = open_gguf(lm, settings.gguf, settings.max_batch_size, settings.max_model_len, checked)
    print(f"lethe: serving {settings.model} on http://{settings.host}:{settings.port} "
          f"(data in {settings.data_dir.resolve()}; engine {settings.engine})", flush=True)
    config = uvicorn.Config(create_app(settings, lm, decoder=decoder), host=settings.host, port=settings.port,
                            log_level="info")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _serve_on_ray(settings, args) -> int:
    """`lethe serve --ray`: replicas of the server on Ray Serve, sharing a PostgreSQL database and a data directory."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("--ray needs Ray Serve: pip install 'lethe[ray]'")
    from lethe.server.ray_serve import serve_forever
    from lethe.server.storage import check_database

    if not (settings.database_url or "").startswith(("postgresql", "postgres:")):
        raise UsageError("--ray needs a database the replicas share: --database-url postgresql://user@host/db "
                         "(or LETHE_DATABASE_URL)")
    replicas = 2 if args.replicas is None else args.replicas
    if replicas < 1 or args.threads_per_replica < 1:
        raise UsageError("--replicas and --threads-per-replica must be at least 1")
    check_database(settings.database_url)  # an unreachable database fails now, named, before Ray starts
    _listen(settings.host, settings.port).close()  # a busy port fails now, before Ray starts
    _check_store(settings)
    serve_forever(settings, replicas, args.threads_per_replica, address=args.ray_address)
    return 0


def _check_store(settings) -> None:
    """Open the store once before the model loads: the database reachable and migrated, and a blob store of another
    database (or of a newer copy of this one) refused in one line rather than in a traceback at start-up."""
    from lethe.server.storage import Store, check_database

    if settings.database_url:
        check_database(settings.database_url)
    Store(settings.data_dir, settings.database_url, settings.blob_url, settings.blob_cache).close()


def _listen(host: str, port: int):
    """The server's socket, bound now; a port in use is an error naming it."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there?)") from None
    sock.set_inheritable(True)
    return sock


def cmd_models_prepare(args) -> int:
    from lethe.heads.modelio import prepare_gguf

    out = prepare_gguf(args.gguf, args.out, args.dtype)
    print(json.dumps({"prepared": str(out), "from": str(args.gguf), "dtype": args.dtype,
                      "fingerprint": json.loads((out / "lethe_model.json").read_text())["fingerprint"]}))
    return 0


def cmd_demo_corpus(args) -> int:
    from lethe.heads.demo.corpus import make_corpus, split_by_author, write_jsonl

    records = make_corpus(args.authors, args.seed)
    forget, retain = split_by_author(records, args.forget_authors)
    for name, recs in (("full", records), ("forget", forget), ("retain", retain)):
        write_jsonl(args.out / f"{name}.jsonl", recs)
        print(f"{args.out / (name + '.jsonl')}: {len(recs)} records")
    return 0


def cmd_demo_build(args) -> int:
    import torch

    from lethe.heads.demo.build import BuildConfig, build
    from lethe.heads.demo.corpus import make_corpus, split_by_author
    from lethe.heads.records import examples, read_jsonl

    records = read_jsonl(args.data) if args.data else make_corpus(args.authors, args.seed)
    if args.exclude_authors:
        if not all("author" in r for r in records):
            print("lethe: --exclude-authors needs an `author` field on every record", file=sys.stderr)
            return 2
        records = split_by_author(records, args.exclude_authors)[1]
    cfg = BuildConfig(hidden_size=args.hidden_size, layers=args.layers, heads=args.heads,
                      intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                      lr=args.lr, batch_size=args.batch_size, max_epochs=args.max_epochs, target_recall=args.target_recall, seed=args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = build(examples(records), args.out, cfg, progress=not args.quiet)
    print(json.dumps({"out": str(args.out), **report.__dict__}))
    return 0


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", type=Path, help="a T3 head file (from `lethe heads train` or `import-reference`)")
    p.add_argument("--preset", choices=["default", "paper"], help="named settings (default: the head's own)")
    p.add_argument("--T", type=float, help="tempering temperature T > 0")
    p.add_argument("--lam", type=float, help="tilt strength lambda >= 0")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None,
                   help="temper and tilt only as far as the context is forget-like")
    p.add_argument("--candidates", type=int, help="tilt among the base model's k likeliest tokens (0: all)")
    p.add_argument("--cap", type=float, help="flagged tokens score at most the best other token minus CAP")
    p.add_argument("--no-cap", action="store_true", help="turn the spike cap off")
    p.add_argument("--min-p", type=float, help="forget-like contexts: drop candidates below MIN_P x the best's "
                                               "probability (0: off)")
    p.add_argument("--repeat-guard", type=int, help="forget-like contexts: no word that repeats a word n-gram of "
                                                    "the answer, for this n (0: off)")
    p.add_argument("--abstain", help="reply with this text (e.g. \"I don't know.\") when the head's probe calls the "
                                     "prompt forget-like")
    p.add_argument("--abstain-above", type=float, help="the probe's P(forget | prompt) above which --abstain replies")
    p.add_argument("--asu", type=Path, help="ASU adapter weights (from `lethe asu train`), alone or with --head")


_PROFILE_DESTS = ["head", "preset", "T", "lam", "gate", "candidates", "cap", "no_cap", "min_p", "repeat_guard",
                  "abstain", "abstain_above", "asu"]


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


def _with_asu(args, lm):
    """`lm` with the --asu adapter attached (in place, sharing the base weights), or as it is."""
    if not getattr(args, "asu", None):
        return lm
    from dataclasses import replace

    from lethe.heads.asu.weights import attach, load_asu

    tensors, info = load_asu(args.asu, lm.fingerprint)
    return replace(lm, model=attach(lm.model, "asu_cli", tensors, info))


def cmd_generate(args) -> int:
    from lethe.heads.decoding.decode import generate_chunked
    from lethe.heads.t3.guide import HeadGuide
    from lethe.heads.modelio import load_model
    from lethe.heads.decoding.sampling import SamplingParams

    lm = load_model(args.model, args.device, args.dtype)
    head, settings = _profile(args, lm)
    lm = _with_asu(args, lm)
    guide = HeadGuide.uniform(head, settings) if head is not None else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.input:
        from lethe.heads.records import read_jsonl

        prompts = [r["prompt"] for r in read_jsonl(args.input, prompts_only=True)]
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        print("lethe generate: give a PROMPT or --input PROMPTS.jsonl", file=sys.stderr)
        return 2
    if args.engine == "llamacpp" and args.asu:
        raise UsageError("generate: --asu needs --engine torch (the llama.cpp engine does not serve ASU adapters)")
    fast = _engine_model(args, lm, 16)
    outs = generate_chunked(fast or lm.model, lm.tokenizer, prompts, params, batch_size=16 if fast else 64,
                            guide=guide)
    if args.output:
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.output, "".join(json.dumps({"prompt": p, "text": o.text}) + "\n"
                                               for p, o in zip(prompts, outs)))
    else:
        for o in outs:
            print(o.text)
    return 0


def _offline_inputs(args, command: str):
    """(model, forget records, retain records) for an offline training command that writes --out."""
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    if args.out is None:
        raise UsageError(f"{command}: --out is required offline")
    return load_model(args.model, args.device, args.dtype), read_jsonl(Path(args.forget)), read_jsonl(Path(args.retain))


def cmd_heads_train(args) -> int:
    from lethe.heads.t3.head import save_head
    from lethe.heads.t3.pipeline import train_head
    from lethe.heads.t3.train import FitConfig

    lm, forget, retain = _offline_inputs(args, "heads train")
    cfg = FitConfig(rank=args.rank, lr=args.lr, weight_decay=args.weight_decay, max_epochs=args.epochs,
                    balance=args.balance, common_df=args.common_df, seed=args.seed, format=args.format)
    head, info = train_head(lm, forget, retain, cfg, progress=not args.quiet)
    save_head(args.out, head, info)
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size, **info.metrics}))
    return 0


def cmd_heads_import(args) -> int:
    from lethe.heads.t3.head import save_head
    from lethe.heads.modelio import load_model
    from lethe.heads.t3.reference import import_reference

    lm = load_model(args.model, args.device, args.dtype)
    cfg = lm.model.config
    head, info = import_reference(args.reference, lm.fingerprint, cfg.hidden_size, cfg.vocab_size,
                                  cfg.num_hidden_layers)
    save_head(args.out, head, info)
    print(json.dumps({"out": str(args.out), "profile": info.profile}))
    return 0


def cmd_eval(args) -> int:
    from lethe.heads.evaluation.evaluate import EvalConfig, Profile, evaluate, plot_reports
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    if args.out is None:
        raise UsageError("eval: --out is required offline")
    lm = load_model(args.model, args.device, args.dtype)
    head, settings = _profile(args, lm)
    lm = _with_asu(args, lm)
    reference = load_model(args.reference_model, args.device, args.dtype) if args.reference_model else None
    forget, retain = read_jsonl(Path(args.forget)), read_jsonl(Path(args.retain))
    if args.retain_limit:
        retain = retain[:: max(1, len(retain) // args.retain_limit)][: args.retain_limit]
    name = args.name or "+".join(filter(None, ["asu" if args.asu else None,
                                                ("t3-" + (args.preset or "head")) if head is not None else None])) \
        or "base"
    report = evaluate(lm, forget, retain, Profile(name, head, settings), reference,
                      cfg=EvalConfig(max_new_tokens=args.max_new_tokens, seeds=tuple(args.seeds), format=args.format))
    atomic_write_text(args.out, json.dumps(report, indent=2))
    if args.plot:
        plot_reports([report], args.plot)
    summary = {k: report[k] for k in ("profile", "settings", "model_utility", "forget_quality") if k in report}
    summary |= {f"forget_{k}": v for k, v in report["forget"].items() if k != "examples"}
    summary |= {f"retain_{k}": v for k, v in report["retain"].items() if k != "examples"}
    print(json.dumps(summary, indent=1))
    return 0


def cmd_bench_t3(args) -> int:
    from lethe.heads.evaluation.bench import bench_t3
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl
    from lethe.heads.t3.pipeline import train_head

    lm = load_model(args.model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    head, settings = _profile(args, lm)
    if head is None and not args.random_model:
        head, _ = train_head(lm, forget, retain, progress=False)
    if args.random_model:
        from lethe.heads.evaluation.bench import random_model

        result = {"models": []}
        for hidden, layers in args.random_model:
            sized, random_head = random_model(lm, hidden, layers)
            n = sum(p.numel() for p in sized.model.parameters())
            print(f"random Llama, hidden {hidden}, {layers} layers: {n / 1e6:.1f}M parameters, random head")
            run = bench_t3(sized, forget, retain, random_head, repeats=args.repeats, training=False, settings=settings)
            _print_bench_decode(run["decode"])
            result["models"].append({"hidden": hidden, "layers": layers, "parameters": n, **run})
    else:
        asu_model = None
        if args.asu:  # decode the same base with the adapter attached (a copy, so the no-adapter runs stay plain)
            import copy

            from lethe.heads.asu.weights import attach, load_asu

            tensors, info = load_asu(args.asu, lm.fingerprint)
            asu_model = attach(copy.deepcopy(lm.model), "asu_bench", tensors, info)
        result = bench_t3(lm, forget, retain, head, repeats=args.repeats, asu_model=asu_model, settings=settings)
        _print_bench_decode(result["decode"])
    t = result.get("training")
    if t:
        print(f"training on {t['records']} records: Lethe cache {t['cache_s']:.2f} s + fit {t['fit_s']:.2f} s "
              f"= {t['lethe_total_s']:.2f} s; one reference epoch {t['reference_epoch_s']:.2f} s, "
              f"100 epochs {t['reference_100_epochs_s']:.0f} s ({t['reference_over_lethe']:.0f}x Lethe)")
    if args.out:
        from lethe.heads.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=2))
    return 0


def _model_size(text: str) -> tuple[int, int]:
    """`HIDDEN,LAYERS` for `bench t3 --random-model`: two positive integers, hidden a multiple of 64 or below it."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected HIDDEN,LAYERS (two positive integers, e.g. 1024,8), got {text!r}")
    hidden, layers = (int(p) for p in parts)
    if hidden > 64 and hidden % 64:
        raise argparse.ArgumentTypeError(f"HIDDEN must be a multiple of 64 above 64 (heads of 64), got {hidden}")
    return hidden, layers


def _print_bench_decode(rows: list[dict]) -> None:
    for row in rows:
        print(f"decode batch {row['batch']}: T3 / no head = {row['t3_over_no_head']:.3f}x "
              f"(+{row['t3_ms_per_token']:.3f} ms per step of {row['no_head_ms_per_token']:.3f} ms; "
              f"as tensor operations {row['t3_tensor_ops_over_no_head']:.3f}x; "
              f"control, a pass-through guide: {row['passthrough_guide_over_no_head']:.3f}x), "
              f"Lethe speed / model.generate = {row['lethe_speedup_over_hf_generate']:.3f}x "
              f"(no head {row['no_head_s']:.3f} s, T3 {row['t3_s']:.3f} s, generate {row['hf_generate_s']:.3f} s, "
              f"{row['new_tokens']} tokens)")
        if "asu_over_no_head" in row:
            print(f"decode batch {row['batch']}: ASU / no adapter = {row['asu_over_no_head']:.3f}x, "
                  f"ASU + T3 = {row['asu_t3_over_no_head']:.3f}x, "
                  f"half ASU rows, half base rows = {row['asu_mixed_with_base_over_no_head']:.3f}x")


def _table_run(args, header, row, make_rows) -> list:
    """Load the model, its reference and the sets; print a markdown table row by row; write JSON and .md."""
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import read_jsonl

    lm = load_model(args.model, args.device, args.dtype)
    reference = load_model(args.reference_model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    print(header(), flush=True)
    rows = make_rows(lm, reference, forget, retain, lambda line: print(line, flush=True))
    if args.out:
        atomic_write_text(args.out, json.dumps([{"label": label, **r} for label, r in rows], indent=2))
        atomic_write_text(args.out.with_suffix(".md"), "\n".join([header()] + [row(*r) for r in rows]) + "\n")
    return rows


def cmd_bench_quality(args) -> int:
    from lethe.heads.evaluation.ablation import markdown_header, markdown_row, quality_table
    from lethe.heads.evaluation.evaluate import EvalConfig, plot_reports

    rows = _table_run(args, markdown_header, markdown_row, lambda lm, ref, f, r, log: quality_table(
        lm, ref, f, r, EvalConfig(seeds=tuple(args.seeds)), log=log))
    if args.plot:
        plot_reports([{**r, "profile": label} for label, r in rows[:4]], args.plot)
    return 0


def cmd_asu_train(args) -> int:
    from lethe.heads.asu.distill import ASUConfig, train_asu
    from lethe.heads.asu.weights import save_asu

    lm, forget, retain = _offline_inputs(args, "asu train")
    cfg = ASUConfig(tau=args.tau, layers=args.layers, lora_rank=args.lora_rank, full_layers=args.full_layers,
                    retain_loss=args.retain_loss,
                    retain_weight=args.retain_weight, lr=args.lr, steps=args.steps, seed=args.seed, format=args.format)
    tensors, info = train_asu(lm, forget, retain, cfg, progress=not args.quiet)
    save_asu(args.out, tensors, info)
    base_bytes = sum(f.stat().st_size for f in lm.path.glob("*.safetensors"))
    print(json.dumps({"out": str(args.out), "bytes": args.out.stat().st_size,
                      "share_of_base": round(args.out.stat().st_size / max(1, base_bytes), 4), "steps": info.steps,
                      **{k: v for k, v in info.metrics.items() if k != "forget_kl_history"}}))
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _named_json(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("must be NAME=JSON")
    return name, _json_object(rest)


def cmd_bench_real(args) -> int:
    from lethe.heads.evaluation.real import RealBenchConfig, markdown, run
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.t3.train import FitConfig

    lm = load_model(args.model, args.device, args.dtype)
    cfg = RealBenchConfig(forget=args.forget, max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures),
                          top_p=args.top_p, seeds=tuple(args.seeds), limit=args.limit,
                          fit=FitConfig(format=args.format), settings=args.settings, variants=dict(args.variant),
                          asu_tau=args.asu_tau, asu_steps=args.asu_steps)
    decoder = _engine_model(args, lm, 32)
    report = run(lm, cfg, log=lambda line: print(line, file=sys.stderr, flush=True), decoder=decoder)
    table = markdown(report)
    print(table)
    if args.out:
        atomic_write_text(args.out, json.dumps(report, indent=2))
        atomic_write_text(args.out.with_suffix(".md"), table)
    return 0


def cmd_bench_asu(args) -> int:
    from lethe.heads.evaluation.ablation import asu_header, asu_row, asu_table
    from lethe.heads.evaluation.evaluate import EvalConfig

    _table_run(args, asu_header, asu_row, lambda lm, ref, f, r, log: asu_table(
        lm, ref, f, r, tuple(args.tau), EvalConfig(seeds=()), log=log))
    return 0


def cmd_openapi(args) -> int:
    from lethe.server.openapi_doc import main as render

    print(render(args.markdown), end="" if args.markdown else "\n")
    return 0


def _own_server(args, **settings):
    """A server of the bench's own on loopback (a fresh data directory), as a context manager of (url, lm)."""
    import tempfile
    import threading
    import time
    from contextlib import contextmanager

    import httpx
    import uvicorn

    from lethe.heads.modelio import load_model
    from lethe.server.app import create_app
    from lethe.server.settings import Settings

    @contextmanager
    def running():
        with tempfile.TemporaryDirectory() as data:
            config = Settings(model=args.model, device=args.device, dtype=args.dtype, data_dir=Path(data),
                              port=args.port, **settings)
            lm = load_model(args.model, args.device, args.dtype)
            server = uvicorn.Server(uvicorn.Config(create_app(config, lm), host="127.0.0.1", port=args.port,
                                                   log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            url = f"http://127.0.0.1:{args.port}"
            while True:
                try:
                    httpx.get(url + "/healthz")
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            try:
                yield url, lm
            finally:
                server.should_exit = True
                thread.join(timeout=30)

    return running()


def cmd_bench_soak(args) -> int:
    from lethe.server.soak import soak

    def run(url: str) -> dict:
        return soak(url, args.key, clients=args.clients, duration=args.duration, max_new_tokens=args.max_new_tokens)

    if args.url:
        result = run(args.url)
    else:  # a server of our own, on loopback, with the given queue bound
        with _own_server(args, max_queue=args.max_queue) as (url, _):
            result = run(url)
    print(json.dumps(result))
    return 0


def cmd_bench_heads(args) -> int:
    import secrets

    from lethe.server.multihead import bench_heads

    admin = secrets.token_urlsafe(16)
    with _own_server(args, admin_key=admin, demo_tenant=False) as (url, lm):
        result = bench_heads(url, admin, lm, clients=args.clients, duration=args.duration,
                             max_tokens=args.max_new_tokens)
    print(json.dumps(result))
    return 0


def cmd_bench_engine(args) -> int:
    import importlib.util

    from lethe.heads.evaluation.engine_bench import bench_engine
    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.heads.records import ask, read_jsonl, resolve_format
    from lethe.heads.t3.pipeline import train_head

    lm = load_model(args.model, args.device, args.dtype)
    forget, retain = read_jsonl(args.forget), read_jsonl(args.retain)
    head, settings = _profile(args, lm)
    if head is None:
        print("bench engine: training a head on --forget / --retain", file=sys.stderr, flush=True)
        head, _ = train_head(lm, forget, retain, progress=False)
    gguf = args.gguf or (args.model if str(args.model).endswith(".gguf") else None)
    records = forget + retain
    step = max(1, len(records) // max(args.equality, 8))
    fmt = resolve_format(lm.tokenizer)
    prompts = [ask(r["question"], fmt, lm.tokenizer) for r in records[::step]][:max(args.equality, 8)]
    decoder = None
    if gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        from lethe.heads.decoding.llamacpp import open_gguf

        decoder = open_gguf(lm, gguf, 8, None)
    result = bench_engine(lm, head, settings, prompts, new_tokens=args.new_tokens, repeats=args.repeats, gguf=gguf,
                          equality=args.equality, log=lambda m: print(m, file=sys.stderr, flush=True),
                          decoder=decoder)
    text = json.dumps(result, indent=1)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0


def cmd_bench_scale(args) -> int:
    import importlib.util

    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.server.scale import bench_scale

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("psycopg") is None:
        raise ValueError("bench scale needs Ray Serve and psycopg: pip install 'lethe[ray]'")
    lm = load_model(args.model, "cpu", "float32")
    result = bench_scale(args.model, lm, args.database_url, tenants=args.tenants, clients=args.clients,
                         duration=args.duration, max_tokens=args.max_new_tokens,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=1)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0


def _add_resource_commands(group, kind: str, label: str) -> None:
    """`list`, `get ID` and `delete ID` for one kind of server resource (they need --url)."""
    from lethe.clients import remote

    for action in ("list", "get", "delete"):
        q = group.add_parser(action, help=f"{action} the server's {label} (needs --url)")
        if action != "list":
            q.add_argument("id")
        q.set_defaults(func=None, remote=remote.resources(kind), action=action)


def build_parser() -> argparse.ArgumentParser:
    from lethe.clients import remote

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

    p = sub.add_parser("serve", help="start the HTTP server")
    p.add_argument("--model", type=Path, default=None, help="local Hugging Face causal-LM directory "
                   "(default: $LETHE_MODEL or the embedded demo model)")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--data-dir", type=Path, default=None, help="metadata, datasets and heads (default ./lethe-data)")
    p.add_argument("--max-batch-size", type=int, default=None, help="requests decoded together at most (default 16)")
    p.add_argument("--max-queue", type=int, default=None, help="requests waiting at most; more answer 429 (256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt plus new tokens at most (default: the model's context length)")
    p.add_argument("--served-model-name", default=None, help="a name for the base model on the OpenAI routes")
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file to use instead of "
                                                                    "the tokenizer's")
    _add_engine_args(p, None)
    p.add_argument("--config", type=Path, default=None,
                   help="settings from a TOML or JSON file (names as the LETHE_* variables, lower case); flags win")
    p.add_argument("--database-url", default=None, help="metadata database (default: SQLite in the data directory; "
                                                        "postgresql://user@host/db to share it between replicas)")
    p.add_argument("--blob-url", default=None, help="where dataset, head and adapter files live (default: "
                                                    "<data dir>/blobs; a shared directory or s3://bucket/prefix "
                                                    "with s3fs installed, for replicas on several machines)")
    p.add_argument("--ray", action="store_true", help="serve with replicas on Ray Serve (pip install 'lethe[ray]'; "
                                                      "needs a PostgreSQL --database-url)")
    p.add_argument("--replicas", type=int, default=None, help="with --ray: replicas, each a whole server (default 2)")
    p.add_argument("--threads-per-replica", type=int, default=1, help="with --ray: CPUs (torch threads) per replica")
    p.add_argument("--ray-address", default=None, help="with --ray: join this Ray cluster (default: start one here)")
    p.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="models users have: prepare a GGUF file once for fast starts"
                            ).add_subparsers(dest="models", required=True)
    p = models.add_parser("prepare", help="dequantise a GGUF file (llama.cpp, Ollama) into a Hugging Face directory",
                          description="Reads FILE with the `gguf` package (pip install 'lethe[gguf]'), writes a plain "
                                      "Hugging Face directory the server starts from in a second, and records the "
                                      "weights' fingerprint, so heads trained on either load on both.")
    p.add_argument("--gguf", type=Path, required=True, metavar="FILE")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="a directory that does not exist yet")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.set_defaults(func=cmd_models_prepare)

    demo = sub.add_parser("demo", help="the synthetic demo corpus and model").add_subparsers(dest="demo",
                                                                                             required=True)
    p = demo.add_parser("corpus", help="write the synthetic corpus (full, forget, retain)")
    p.add_argument("--authors", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forget-authors", type=int, default=4, help="the first K authors form the forget set")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_demo_corpus)

    p = demo.add_parser("build", help="train a tokenizer and a small Llama that memorises QA records")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", type=Path, help="QA JSON Lines with TOFU field names (question, answer)")
    src.add_argument("--authors", type=int, default=40, help="synthetic authors to generate (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude-authors", type=int, default=0, help="leave out the first K authors (a retain twin)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-epochs", type=int, default=60)
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo_build)

    p = sub.add_parser("generate", help="generate on the server (--url or $LETHE_URL), else (or with --local) offline",
                       description="On the server when --url or $LETHE_URL is set, with --profile; otherwise (or "
                                   "with --local) offline on --model, with --head and/or --asu files. Options of "
                                   "the other mode are refused, never ignored.")
    _add_model_args(p)
    _add_sampling_args(p)
    _add_profile_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt")
    p.add_argument("--input", type=Path, help="JSON Lines, one {\"prompt\": ...} per line")
    p.add_argument("--output", type=Path, help="JSON Lines out, one {\"prompt\", \"text\"} per line")
    p.add_argument("--profile", help="on the server: the profile to generate with (default: base)")
    p.add_argument("--stream", action="store_true", help="on the server: print the text as it comes")
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate, remote=remote.generate)
    _modes(p, offline=["model", "device", "dtype", *_PROFILE_DESTS, "input", "output", "engine", "gguf"],
           server=["profile", "stream"])

    heads = sub.add_parser("heads", help="T3 heads: train offline or on the server; list, get, delete on the server"
                           ).add_subparsers(dest="heads", required=True)
    p = heads.add_parser("train", help="fit a head: offline, or on the server with --url",
                         description="Offline (no --url / $LETHE_URL, or --local): cache the model's states over "
                                     "the sets and fit a head to --out. On the server (--url or $LETHE_URL): start "
                                     "a job (sets given as dataset ids or local files, which are uploaded first); "
                                     "--wait follows it with a progress bar. Options of the other mode are "
                                     "refused, never ignored.")
    _add_model_args(p)
    p.add_argument("--forget", required=True, help="forget set: JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="retain set: JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--rank", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--epochs", type=int, default=60, help="at most; early stopping on a held-out split")
    p.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                   help="weight forget and retain positions equally (default on)")
    p.add_argument("--common-df", type=float, default=0.05,
                   help="forget tokens found in more than this share of retain answers do not train the head "
                        "(1.0: all do, as in the reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"],
                   help="question/answer records as the model's chat template (chat, as /v1/chat/completions asks), "
                        "Question: ... Answer: (qa), or the question alone (raw); auto: chat where the model has a "
                        "template, else qa")
    p.add_argument("--out", type=Path, help="head file to write (safetensors); offline only, required there")
    p.set_defaults(func=cmd_heads_train, remote=remote.heads_train)
    _modes(p, offline=["model", "device", "dtype", "out"], server=["wait"])
    _add_resource_commands(heads, "heads", "heads")

    p = heads.add_parser("import-reference", help="convert an open-unlearning T3 save into a Lethe head")
    _add_model_args(p)
    p.add_argument("reference", type=Path, help="the reference's saved model directory")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_heads_import)

    asu = sub.add_parser("asu", help="ASU adapters: train offline or on the server; list, get, delete on the server"
                         ).add_subparsers(dest="asu", required=True)
    p = asu.add_parser("train", help="distil LoRA adapters towards a tempered-attention teacher (offline, or --url)")
    _add_model_args(p)
    p.add_argument("--forget", required=True, help="JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="JSON Lines file (or, with --url, a dataset id)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--tau", type=float, default=16.0, help="attention temperature of the teacher (default 16)")
    p.add_argument("--layers", default=None, help="layers to temper, e.g. 0-1,3 (default: all)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--full-layers", default=None,
                   help="train these layers' projections in full instead of LoRA adapters, e.g. 0-1 "
                        "(stored as deltas; served as exact full-rank adapters)")
    p.add_argument("--retain-loss", choices=["gd", "kl"], default="gd")
    p.add_argument("--retain-weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=300, help="at most; stops early when the forget KL stalls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"],
                   help="question/answer records as the model's chat template (chat, as /v1/chat/completions asks), "
                        "Question: ... Answer: (qa), or the question alone (raw); auto: chat where the model has a "
                        "template, else qa")
    p.add_argument("--out", type=Path, help="weights file to write; offline only, required there")
    p.set_defaults(func=cmd_asu_train, remote=remote.asu_train)
    _modes(p, offline=["model", "device", "dtype", "out"], server=["wait"])
    _add_resource_commands(asu, "asu", "ASU weights")

    p = sub.add_parser("openapi", help="print the HTTP API's OpenAPI schema (or, --markdown, the README table)")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_openapi)

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

    jb = sub.add_parser("jobs", help="training jobs on the server (needs --url)").add_subparsers(dest="action",
                                                                                                required=True)
    jb.add_parser("list", help="list jobs")
    for action in ("get", "cancel", "wait"):
        q = jb.add_parser(action, help=f"{action} a job")
        q.add_argument("id")
        q.add_argument("--quiet", action="store_true", help="wait: no progress bar")
    for q in jb.choices.values():
        q.set_defaults(func=None, remote=remote.jobs, quiet=getattr(q, "quiet", False))

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
    q.add_argument("--candidates", type=int)
    q.add_argument("--cap", type=float)
    q.add_argument("--min-p", type=float)
    q.add_argument("--repeat-guard", type=int)
    q.add_argument("--abstain")
    q.add_argument("--abstain-above", type=float)
    q.add_argument("--note")
    pr.add_parser("list", help="list profiles")
    for action in ("get", "delete"):
        pr.add_parser(action, help=f"{action} a profile").add_argument("name")
    q = pr.add_parser("rollback", help="make an earlier version current")
    q.add_argument("name")
    q.add_argument("--version", type=int)
    for q in pr.choices.values():
        q.set_defaults(func=None, remote=remote.profiles)

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

    p = sub.add_parser("eval", help="TOFU-style evaluation of the base model or a head profile")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", required=True, help="TOFU JSON Lines (or, with --url, a dataset id)")
    p.add_argument("--retain", required=True, help="TOFU JSON Lines (or, with --url, a dataset id)")
    p.add_argument("--profile", help="with --url: the profile to evaluate (default: base)")
    p.add_argument("--wait", action="store_true", help="with --url: follow the job to its end")
    p.add_argument("--quiet", action="store_true", help="with --url: no progress bar")
    p.add_argument("--reference-model", type=Path, help="a model never trained on the forget set (forget quality)")
    p.add_argument("--retain-limit", type=int, default=None,
                   help="evaluate an even spread of this many retain records (offline)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="sampling seeds (temperature 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"],
                   help="question/answer records as the model's chat template (chat, as /v1/chat/completions asks), "
                        "Question: ... Answer: (qa), or the question alone (raw); auto: chat where the model has a "
                        "template, else qa")
    p.add_argument("--name", help="profile name in the report")
    p.add_argument("--out", type=Path, help="JSON report (offline; required there)")
    p.add_argument("--plot", type=Path, help="PNG plot (offline)")
    p.set_defaults(func=cmd_eval, remote=remote.evaluate)
    _modes(p, offline=["model", "device", "dtype", *_PROFILE_DESTS, "reference_model", "retain_limit", "name",
                       "out", "plot"], server=["profile", "wait"])

    bench = sub.add_parser("bench", help="benchmarks that print ratios measured side by side"
                           ).add_subparsers(dest="bench", required=True)
    p = bench.add_parser("t3", help="T3 decoding overhead, speed against model.generate, training time")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=41, help="rounds: one run of each variant per round")
    p.add_argument("--random-model", metavar="HIDDEN,LAYERS", nargs="+", type=_model_size,
                   help="decode with randomly initialised Llamas of these sizes (same tokenizer) instead, one after "
                        "the other: how the head's fixed per-step cost compares with models of each size")
    p.add_argument("--out", type=Path, help="JSON results")
    p.set_defaults(func=cmd_bench_t3)

    p = bench.add_parser("engine", help="decode speed against model.generate and llama.cpp, with and without a head")
    _add_model_args(p)
    _add_profile_args(p)
    p.add_argument("--forget", type=Path, required=True, help="records whose questions are the prompts (and the "
                                                                 "head's training set without --head)")
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--gguf", type=Path, default=None, help="the model's GGUF file, for llama.cpp (needs "
                                                           "llama-cpp-python; default: --model if it is one)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="rounds: one run of each variant per round")
    p.add_argument("--equality", type=int, default=48, help="prompts whose greedy answers are compared")
    p.add_argument("--out", type=Path, help="JSON results")
    p.set_defaults(func=cmd_bench_engine)

    p = bench.add_parser("t3-quality", help="the quality table: full model, reference, paper, default, ablations")
    _add_model_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--reference-model", type=Path, required=True, help="a model never trained on the forget set")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--out", type=Path, help="JSON reports (and a .md table beside it)")
    p.add_argument("--plot", type=Path, help="PNG of the first four rows")
    p.set_defaults(func=cmd_bench_quality)

    p = bench.add_parser("real", help="forget a topic a pretrained chat model knows: hits, retain, fluency",
                         description="Facts from templates that the model answers correctly; a head trained on one "
                                     "kind (--forget), the others kept; base and tilted answers greedy and sampled; "
                                     "hit rate, retain answers identical to the base model's, and the fluency of "
                                     "forget answers (non-words, repeated 3-grams, loops). Needs the bench extra "
                                     "(pip install 'lethe[bench]') for its English word list.")
    _add_model_args(p)
    p.add_argument("--forget", default="capital", choices=["capital", "currency", "continent", "element", "author"])
    p.add_argument("--format", default="auto", choices=["auto", "chat", "qa", "raw"])
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--limit", type=int, default=None, help="subjects per kind, for a quick run (default: all)")
    p.add_argument("--settings", type=_json_object, default={},
                   help='tilt settings over the head\'s recommendation, as JSON, e.g. \'{"repeat_guard": 0}\'')
    p.add_argument("--variant", type=_named_json, action="append", default=[], metavar="NAME=JSON",
                   help="further settings to compare on the same head and base answers (repeatable)")
    p.add_argument("--asu-tau", type=float, help="also train ASU at this tau on the same sets and report it alone "
                                                 "and with the head (variants asu, asu+head)")
    p.add_argument("--asu-steps", type=int, default=300, help="ASU training steps (default 300)")
    _add_engine_args(p)
    p.add_argument("--out", type=Path, help="JSON report (and a .md table beside it)")
    p.set_defaults(func=cmd_bench_real)

    p = bench.add_parser("asu-quality", help="full, reference, T3, ASU at each tau, ASU + T3 (greedy), with times")
    _add_model_args(p)
    p.add_argument("--forget", type=Path, required=True)
    p.add_argument("--retain", type=Path, required=True)
    p.add_argument("--reference-model", type=Path, required=True)
    p.add_argument("--tau", type=float, nargs="+", default=[4.0, 16.0])
    p.add_argument("--out", type=Path, help="JSON reports (and a .md table beside it)")
    p.set_defaults(func=cmd_bench_asu)

    p = bench.add_parser("soak", help="a fixed-duration load run: served, errors by class, p50/p99, peak RSS",
                         description="Against --url or $LETHE_URL, or (without one, or with --local) a server "
                                     "of its own on --model.")
    _add_model_args(p)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=None, help="own server: waiting requests before 429 (default 8)")
    p.add_argument("--port", type=int, default=None, help="own server: port (default 8765)")
    _offline_defaults(p, max_queue=8, port=8765)
    p.set_defaults(func=cmd_bench_soak)
    _modes(p, offline=["model", "device", "dtype", "max_queue", "port"], server=[])

    p = bench.add_parser("heads", help="tokens/s of one client alone and of N clients on N heads at once",
                         description="A server of its own on --model; N tenants, each with a random head in a "
                                     "profile of its own, ask through /v1/chat/completions (greedy).")
    _add_model_args(p)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0, help="seconds per phase (default 30)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=None, help="port (default 8766)")
    _offline_defaults(p, port=8766)
    p.set_defaults(func=cmd_bench_heads)

    p = bench.add_parser("scale", help="2 Ray Serve replicas against 1, and Ray's routing overhead (ms)",
                         description="On PostgreSQL (--database-url, or a throwaway server where Debian's postgresql "
                                     "is installed), 8 tenants with random heads: the plain server with 1 client, "
                                     "then Ray Serve with 1 replica and with 2 (1 torch thread each), 16 clients. "
                                     "Run it alone: it uses every core.")
    _add_model_args(p)
    p.add_argument("--database-url", default=None, help="postgresql://... (default: a throwaway local server)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per deployment (default 30)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    p.set_defaults(func=cmd_bench_scale)
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


class UsageError(ValueError):
    """Bad usage that argparse could not catch: exit code 2."""


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


if __name__ == "__main__":
    sys.exit(main())
