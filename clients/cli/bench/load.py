"""`lethe bench soak`, `heads`, `scale` and `fairness`: a server under load."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lethe.clients.cli.common import UsageError, _add_model_args, _modes, _offline_defaults


def register(bench: argparse._SubParsersAction) -> None:
    """`lethe bench soak`, `heads`, `scale` and `fairness`."""
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

    p = bench.add_parser("fairness", help="a victim tenant's latency while another caller runs at its full allowance",
                         description="A server of its own on --model (`lethe serve` in a process of its own): a "
                                     "victim tenant's short requests alone, then beside an anonymous and a keyed "
                                     "aggressor each holding all the requests one "
                                     "caller may have in flight, then single heavy requests; /healthz probed "
                                     "throughout. Run it alone.")
    _add_model_args(p)
    p.add_argument("--victim-requests", type=int, default=40)
    p.add_argument("--victim-tokens", type=int, default=8)
    p.add_argument("--aggressor-tokens", type=int, default=256)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--quota-rows", type=int, default=32, help="requests one caller may have in flight (default 32)")
    p.add_argument("--rows-per-caller", type=int, nargs="+", default=[0, 4],
                   help="LETHE_MAX_ROWS_PER_CALLER values to run the bench with, one server each (0: the default, "
                        "half the batch; default: 0 4)")
    p.add_argument("--port", type=int, default=None, help="port (default 8767)")
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    _offline_defaults(p, port=8767)
    p.set_defaults(func=cmd_bench_fairness)


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

    engine, gguf = getattr(args, "engine", "torch"), getattr(args, "gguf", None)
    if gguf is not None and engine != "llamacpp":
        raise UsageError("--gguf names the file the llama.cpp engine decodes: add --engine llamacpp")

    @contextmanager
    def running():
        with tempfile.TemporaryDirectory() as data:
            config = Settings(model=args.model, device=args.device, dtype=args.dtype, data_dir=Path(data),
                              port=args.port, engine=engine, gguf=gguf, **settings)
            decoder, checked = None, None
            if engine == "llamacpp":  # the build and the file, before the model loads (as `lethe serve` does)
                from lethe.heads.decoding.llamacpp import gguf_for, open_gguf

                checked = gguf_for(config.model, config.gguf)
            lm = load_model(args.model, args.device, args.dtype)
            if checked is not None:
                decoder = open_gguf(lm, config.gguf, config.max_batch_size, config.max_model_len, checked)
            server = uvicorn.Server(uvicorn.Config(create_app(config, lm, decoder=decoder), host="127.0.0.1",
                                                   port=args.port, log_level="warning"))
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
    from lethe.server.bench.soak import soak

    def run(url: str) -> dict:
        return soak(url, args.key, clients=args.clients, duration=args.duration, max_new_tokens=args.max_new_tokens)

    if args.url:
        result = run(args.url)
    else:  # a server of our own, on loopback, with the given queue bound
        # its clients are anonymous, and it reads the server's memory from /metrics
        with _own_server(args, max_queue=args.max_queue, allow_anonymous=True, metrics_public=True) as (url, _):
            result = run(url)
    print(json.dumps(result))
    return 0


def cmd_bench_heads(args) -> int:
    import secrets

    from lethe.server.bench.heads import bench_heads

    admin = secrets.token_urlsafe(16)
    with _own_server(args, admin_key=admin, demo_tenant=False) as (url, lm):
        result = bench_heads(url, admin, lm, clients=args.clients, duration=args.duration,
                             max_tokens=args.max_new_tokens)
    print(json.dumps(result))
    return 0


def cmd_bench_scale(args) -> int:
    import importlib.util

    from lethe.heads.io import atomic_write_text
    from lethe.heads.modelio import load_model
    from lethe.server.bench.scale import bench_scale

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


def cmd_bench_fairness(args) -> int:
    import secrets
    import tempfile

    from lethe.heads.io import atomic_write_text
    from lethe.server.bench import shown_path
    from lethe.server.bench.fairness import bench_fairness
    from lethe.server.bench.scale import plain_server

    runs = {}
    for per_caller in args.rows_per_caller:  # one server each, one after the other
        admin = secrets.token_urlsafe(16)
        settings = {"LETHE_ALLOW_ANONYMOUS": "true", "LETHE_MAX_BATCH_SIZE": str(args.max_batch_size),
                    "LETHE_QUOTA_ROWS": str(args.quota_rows), "LETHE_DEVICE": args.device, "LETHE_DTYPE": args.dtype}
        if per_caller:
            settings["LETHE_MAX_ROWS_PER_CALLER"] = str(per_caller)
        name = f"rows_per_caller_{per_caller}" if per_caller else "rows_per_caller_default"
        print(f"{name}:", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as data, \
                plain_server(args.model, Path(data), None, admin, args.port, threads=2, env=settings) as url:
            runs[name] = bench_fairness(url, admin, rows=args.quota_rows, victim_requests=args.victim_requests,
                                        victim_tokens=args.victim_tokens, aggressor_tokens=args.aggressor_tokens,
                                        log=lambda m: print(m, file=sys.stderr, flush=True))
    result = {"model": shown_path(args.model), "max_batch_size": args.max_batch_size, **runs}
    text = json.dumps(result, indent=1)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0
