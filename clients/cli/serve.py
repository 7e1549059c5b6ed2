"""`lethe serve`: the HTTP server, alone or as replicas on Ray Serve."""

from __future__ import annotations

import argparse
from pathlib import Path

from lethe.clients.cli.common import UsageError, _add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    """`lethe serve`."""
    p = sub.add_parser("serve", help="start the HTTP server")
    p.add_argument("--model", type=Path, default=None, help="local Hugging Face causal-LM directory "
                   "(default: $LETHE_MODEL or the embedded demo model)")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--data-dir", type=Path, default=None, help="metadata, datasets and heads (default ./lethe-data)")
    p.add_argument("--max-batch-size", type=int, default=None, help="requests decoded together at most (default 16)")
    p.add_argument("--max-rows-per-caller", type=int, default=None,
                   help="rows of the batch one tenant (or the anonymous callers together) may hold (default half "
                        "the batch; up to the batch lets a lone caller fill it, but for an eighth kept free)")
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


def cmd_serve(args) -> int:
    import logging
    import os

    import uvicorn
    from pydantic import ValidationError

    from lethe.heads.modelio import load_model
    from lethe.server.app import create_app, use_chat_template
    from lethe.server.settings import Settings, read_config

    flags = {"model": args.model, "host": args.host, "port": args.port, "device": args.device, "dtype": args.dtype,
             "data_dir": args.data_dir, "max_batch_size": args.max_batch_size,
             "max_rows_per_caller": args.max_rows_per_caller, "max_queue": args.max_queue,
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
    if settings.engine == "llamacpp":  # llama-cpp-python is built apart (`make llamacpp`): missing, fail first
        from lethe.heads.decoding.llamacpp import _library

        _library()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.blob_url:
        from lethe.server.blobs import check_blob_url

        check_blob_url(settings.blob_url)  # a store that cannot be used fails now, in one line
    if args.ray:
        return _serve_on_ray(settings, args)
    if args.replicas is not None or args.ray_address is not None:
        raise UsageError("--replicas and --ray-address need --ray")
    sock = _listen(settings.host, settings.port)  # first: a busy port fails before a model loads or a key is made
    from lethe.server.storage import hold_data_dir

    # one process on SQLite: the data directory is this server's alone, for as long as `held` is open
    held = hold_data_dir(settings.data_dir) if not settings.database_url else None  # noqa: F841
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
    if settings.allow_anonymous:
        print("lethe: anonymous access is on: requests without a key get the base model"
              + (" (the default on the embedded demo model only)" if "allow_anonymous" not in values
                 and not os.environ.get("LETHE_ALLOW_ANONYMOUS") else "")
              + "; LETHE_ALLOW_ANONYMOUS=false turns it off", flush=True)
    uvicorn.Server(uvicorn_config(create_app(settings, lm, decoder=decoder), settings)).run(sockets=[sock])
    return 0


def uvicorn_config(app, settings):
    """uvicorn's settings for the server. Its own access log is off: it prints raw paths with their query strings
    (`?name=rtbf-john-doe`); Lethe's (`server.app.AccessLog`) logs route templates, statuses and times."""
    import uvicorn

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False)


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
    from lethe.server.app import check_served_name

    store = Store(settings.data_dir, settings.database_url, settings.blob_url, settings.blob_cache)
    try:
        check_served_name(store, settings.served_model_name)  # a name that shadows a profile fails here, in one line
    finally:
        store.close()


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
