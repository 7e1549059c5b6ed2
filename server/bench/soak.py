"""`lethe bench soak`: a fixed-duration load run against a server, on loopback.

N clients post /generate in a loop; besides them, one slow client reads a stream one event per
second and other clients open streams and leave after the first event. Reported: requests served,
errors by class, p50/p99 latency of the served requests, 429s (and whether each had Retry-After), and
the server's peak resident memory, read from its /metrics (process_resident_memory_bytes).
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections import Counter

import httpx

PROMPT = "Question: Where was Zapeavund Kusais born?\nAnswer:"


def _rss(client: httpx.Client) -> float | None:
    text = client.get("/metrics").text
    m = re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def soak(url: str, key: str | None = None, clients: int = 16, duration: float = 10.0, max_new_tokens: int = 32,
         leavers: int = 2, slow_readers: int = 1, slow_reader_key: str | None = None) -> dict:
    """`clients` callers asking for `max_new_tokens` in a loop for `duration` seconds with `key` (anonymous:
    None), beside `leavers` that leave streams after one event and `slow_readers` that read one event a second
    (with `slow_reader_key`, as a tenant of their own). Two requests warm the server first, outside the
    measured `duration`: a server's first requests pay one-off costs (thread pools, first kernels) that are
    not load."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    retry_after_missing = 0
    served = left = slow_events = 0
    lock = threading.Lock()
    body = {"prompt": PROMPT, "max_new_tokens": max_new_tokens, "temperature": 1.0}

    def worker():
        nonlocal served, retry_after_missing
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    r = c.post("/generate", json=body)
                except httpx.TimeoutException:
                    kind = "timeout"
                except httpx.TransportError:
                    kind = "connection"
                else:
                    kind = None if r.status_code == 200 else str(r.status_code)
                with lock:
                    if kind is None:
                        served += 1
                        latencies.append(time.perf_counter() - started)
                    else:
                        errors[kind] += 1
                        if kind == "429" and "retry-after" not in r.headers:
                            retry_after_missing += 1
                if kind == "429":
                    time.sleep(float(r.headers.get("retry-after", "1")) / 10)

    def leaver():  # opens a stream, reads one event, goes away
        nonlocal left, retry_after_missing
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            while time.monotonic() < stop:
                try:
                    with c.stream("POST", "/generate", json=body | {"stream": True, "max_new_tokens": 200}) as r:
                        if r.status_code != 200:
                            with lock:
                                errors[str(r.status_code)] += 1
                                retry_after_missing += r.status_code == 429 and "retry-after" not in r.headers
                            time.sleep(0.1)
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                break
                    with lock:
                        left += 1
                except httpx.HTTPError:
                    with lock:
                        errors["leaver"] += 1
                time.sleep(0.05)

    def slow_reader():  # reads a long stream one event per second (retrying while the queue is full)
        nonlocal slow_events
        own = {"Authorization": f"Bearer {slow_reader_key}"} if slow_reader_key else headers
        with httpx.Client(base_url=url, headers=own, timeout=60) as c:
            while time.monotonic() < stop:
                try:
                    with c.stream("POST", "/generate", json=body | {"stream": True, "max_new_tokens": 200}) as r:
                        if r.status_code == 429:
                            time.sleep(0.1)
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                with lock:
                                    slow_events += 1
                                if time.monotonic() > stop:
                                    break
                                time.sleep(1.0)
                except httpx.HTTPError:
                    with lock:
                        errors["slow"] += 1

    with httpx.Client(base_url=url, timeout=30) as probe:
        for _ in range(2):
            probe.post("/generate", json=body, headers=headers).raise_for_status()
        rss_start = _rss(probe)
        stop = time.monotonic() + duration
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        threads += [threading.Thread(target=leaver) for _ in range(leavers)]
        threads += [threading.Thread(target=slow_reader) for _ in range(slow_readers)]
        for t in threads:
            t.start()
        peak = rss_start or 0.0
        while any(t.is_alive() for t in threads):
            value = _rss(probe)
            peak = max(peak, value or 0.0)
            time.sleep(0.2)
        for t in threads:
            t.join()
        health = probe.get("/healthz").status_code
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [latencies[0] if latencies else 0.0] * 99
    return {"duration_s": duration, "clients": clients, "served": served, "errors": dict(errors),
            "rate_limited_without_retry_after": retry_after_missing, "p50_s": round(q[49], 3), "p99_s": round(q[98], 3),
            "left_early": left, "slow_reader_events": slow_events,
            "rss_start_mb": round((rss_start or 0) / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
            "healthy_after": health == 200}
