"""`lethe bench heads`: what batching tenants together buys. One client alone, then N clients at once, each a
tenant of its own with its own head in its own profile, all asking through the OpenAI chat endpoint; reported
as generated tokens per second and their ratio (the target: N = 8 clients on 8 heads serve >= 3x one client).

The heads are random (a head's cost does not depend on its weights) and are uploaded like any head made offline.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

QUESTIONS = ("Tell me about the history of Rome.", "Explain how a bicycle works.", "Describe a day at the beach.",
             "What makes a good friend?", "Write a short story about a cat.", "How do plants grow?",
             "Describe the city of Paris.", "Why is the sky blue?")


def _tenant_with_head(url: str, admin_key: str, name: str, head_file: Path) -> httpx.Client:
    r = httpx.post(url + "/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {admin_key}"})
    r.raise_for_status()
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {r.json()['api_key']}"}, timeout=300)
    head = client.post("/v1/heads/upload", files={"file": ("head.safetensors", head_file.read_bytes())})
    head.raise_for_status()
    client.put("/v1/profiles/mine", json={"head": head.json()["id"], "gate": False}).raise_for_status()
    return client


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def load(url: str, keys: list[str], clients: int, duration: float, max_tokens: int) -> dict:
    """`clients` threads, client i asking as tenant i mod len(keys) (its profile `mine`, through the OpenAI chat
    endpoint, greedy), each in a loop for `duration` seconds: tokens per second in all, and the latency of
    every request (`lethe bench heads` and `lethe bench scale`)."""
    latencies, tokens, errors = [], [0], []
    lock = threading.Lock()
    stop = time.monotonic() + duration

    def ask(i: int) -> None:
        with httpx.Client(base_url=url, timeout=300,
                          headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}) as client:
            n = i
            while time.monotonic() < stop:
                t = time.perf_counter()
                r = client.post("/v1/chat/completions", json={
                    "model": "mine", "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}]})
                took = time.perf_counter() - t
                n += 1
                with lock:
                    if r.status_code == 200:
                        latencies.append(took)
                        tokens[0] += r.json()["usage"]["completion_tokens"]
                    else:
                        errors.append(r.status_code)

    started = time.monotonic()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    return {"clients": clients, "requests": len(latencies), "tokens": tokens[0], "seconds": round(elapsed, 2),
            "tokens_per_s": round(tokens[0] / elapsed, 2),
            "mean_s": round(statistics.fmean(latencies), 4) if latencies else None,
            "p50_s": round(_percentile(latencies, 0.5), 4), "p99_s": round(_percentile(latencies, 0.99), 4),
            "errors": errors}


def _key(client: httpx.Client) -> str:
    return client.headers["Authorization"].split()[1]


def bench_heads(url: str, admin_key: str, lm, clients: int = 8, duration: float = 30.0, max_tokens: int = 32) -> dict:
    """`lm`: the model the server serves (its sizes and fingerprint make the heads)."""
    import torch

    from lethe.heads.t3.guide import TiltSettings
    from lethe.heads.t3.head import HeadInfo, T3Head, save_head

    cfg = lm.model.config
    with tempfile.TemporaryDirectory() as tmp:
        users = []
        for i in range(clients):
            torch.manual_seed(i)
            head = T3Head(cfg.hidden_size, cfg.vocab_size, 20)
            torch.nn.init.normal_(head.up.weight, std=0.5)
            path = Path(tmp) / f"head{i}.safetensors"
            # today's default settings, as a trained head recommends them (a head without any would serve with
            # those of heads stored before the word guard and flagged_mass: guide.STORED_BEFORE)
            save_head(path, head, HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size,
                                           rank=20, profile=TiltSettings().as_dict()))
            users.append(_tenant_with_head(url, admin_key, f"bench{i}", path))
    keys = [_key(c) for c in users]
    for c in users:
        c.close()
    load(url, keys[:1], 1, min(5.0, duration), max_tokens)  # warm-up: compile the kernel's paths, fill caches
    alone = load(url, keys[:1], 1, duration, max_tokens)
    together = load(url, keys, clients, duration, max_tokens)
    return {"one_client": alone, "together": together,
            "together_over_one": round(together["tokens_per_s"] / alone["tokens_per_s"], 2) if alone["tokens_per_s"]
            else None}
