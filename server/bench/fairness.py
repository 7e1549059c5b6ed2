"""`lethe bench fairness`: a victim tenant's short requests while an aggressor runs at its full allowance.

Phases, one after another on one server: the victim alone; an anonymous aggressor, then a keyed one (another
tenant), each with as many long requests in flight as the server lets one caller have (LETHE_QUOTA_ROWS), sent
again as each ends; then single heavy requests one at a time (a 1 MB /tokenize body, 16 echoed prompts with 20
alternatives each). In every phase a probe reads /healthz every 20 ms. Reported: the victim's p50 and p99 against
its latency alone, /healthz p50 and p99, the aggressor's answers and 429s; the bars are issue 25's (victim p50 <= 2x
alone, p99 <= 3x; /healthz p99 <= 50 ms).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from lethe.server.bench.heads import _percentile

VICTIM = "Question: What is the capital of France?\nAnswer:"
AGGRESSOR = "Write a long story about a lighthouse keeper and the sea, with many characters.\n"


def _ms(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(1000 * statistics.median(values), 1),
            "p99_ms": round(1000 * _percentile(values, 0.99), 1), "max_ms": round(1000 * max(values), 1)}


_PROBE = """
import sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
times = []
with httpx.Client(base_url=sys.argv[1], timeout=30) as c:
    while not stop.is_set():
        started = time.perf_counter()
        c.get("/healthz").raise_for_status()
        times.append(time.perf_counter() - started)
        if len(times) == 1:
            print("ready", flush=True)
        stop.wait(float(sys.argv[2]))
print(" ".join(map(repr, times)), flush=True)
"""


class _Probe:
    """Reads /healthz every `every` seconds until stopped, from a process of its own: a thread of the bench's
    process would count the bench's own work (encoding a 1 MB request, decoding its answer) as the server's."""

    def __init__(self, url: str, every: float = 0.02):
        self.url, self.every, self.times = url, every, []

    def __enter__(self):
        import subprocess
        import sys

        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url, str(self.every)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the /healthz probe of {self.url} did not start")
        return self

    def __exit__(self, *exc):
        out, _ = self._proc.communicate("", timeout=60)
        self.times = [float(v) for v in out.split()]


def _victim(url: str, key: str, requests: int, new_tokens: int) -> list[float]:
    body = {"model": "base", "prompt": VICTIM, "max_tokens": new_tokens, "min_tokens": new_tokens, "temperature": 0}
    times = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        for _ in range(requests):
            started = time.perf_counter()
            c.post("/v1/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - started)
    return times


class _Aggressor:
    """`clients` threads each sending a long request again as soon as the last one ended (or after Retry-After)."""

    def __init__(self, url: str, key: str | None, clients: int, new_tokens: int):
        self.url, self.clients = url, clients
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.body = {"model": "base", "prompt": AGGRESSOR, "max_tokens": new_tokens, "min_tokens": new_tokens,
                     "temperature": 1.0}
        self.codes: Counter[str] = Counter()
        self.error: str | None = None
        self.tokens = 0  # in the answers it got
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=600) as c:
            while not self._stop.is_set():
                r = c.post("/v1/completions", json=self.body)
                self.codes[str(r.status_code)] += 1
                if r.status_code == 200:
                    self.tokens += r.json()["usage"]["completion_tokens"]
                elif r.status_code == 429:
                    self._stop.wait(float(r.headers.get("retry-after", "1")))
                else:  # the bench's own mistake: say so rather than measure a spin
                    self.error = self.error or r.text
                    self._stop.set()

    def __enter__(self):
        self.started = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=900)
        self.seconds = time.perf_counter() - self.started


def bench_fairness(url: str, admin_key: str, *, rows: int, victim_requests: int = 40, victim_tokens: int = 8,
                   aggressor_tokens: int = 256, warm_up: float = 3.0,
                   log: Callable[[str], None] = lambda m: None) -> dict:
    """`rows`: the requests one caller may have in flight (the server's LETHE_QUOTA_ROWS)."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    keys = {name: httpx.post(url + "/admin/tenants", json={"name": name}, headers=admin, timeout=60)
            .raise_for_status().json()["api_key"] for name in ("victim", "aggressor")}
    context = httpx.post(url + "/tokenize", json={"prompt": AGGRESSOR}, timeout=60).raise_for_status().json()
    aggressor_tokens = min(aggressor_tokens, context["max_model_len"] - context["count"])  # as long as it may be
    _victim(url, keys["victim"], 3, victim_tokens)  # warm-up: first-call costs are not the victim's latency
    result: dict = {"settings": {"aggressor_rows": rows, "victim_requests": victim_requests,
                                 "victim_tokens": victim_tokens, "aggressor_tokens": aggressor_tokens}}
    with _Probe(url) as probe:
        alone = _victim(url, keys["victim"], victim_requests, victim_tokens)
    result["alone"] = {"victim": _ms(alone), "healthz": _ms(probe.times)}
    log(f"alone: victim p50 {result['alone']['victim']['p50_ms']} ms")
    for phase, key in (("anonymous_aggressor", None), ("keyed_aggressor", keys["aggressor"])):
        with _Aggressor(url, key, rows, aggressor_tokens) as aggressor:
            time.sleep(warm_up)  # the aggressor's rows fill the batch first
            with _Probe(url) as probe:
                times = _victim(url, keys["victim"], victim_requests, victim_tokens)
        if aggressor.error:
            raise RuntimeError(f"the aggressor's request failed: {aggressor.error}")
        victim = _ms(times)
        result[phase] = {"victim": victim, "healthz": _ms(probe.times), "aggressor_answers": dict(aggressor.codes),
                         "aggressor_tokens_per_s": round(aggressor.tokens / aggressor.seconds, 1),
                         "victim_p50_over_alone": round(victim["p50_ms"] / result["alone"]["victim"]["p50_ms"], 2),
                         "victim_p99_over_alone": round(victim["p99_ms"] / result["alone"]["victim"]["p50_ms"], 2)}
        log(f"{phase}: victim p50 {victim['p50_ms']} ms, p99 {victim['p99_ms']} ms")
    heavy = {"tokenize_1mb": ("/tokenize", {"prompt": "word " * 200_000}),
             "echo_16_prompts_logprobs_20": ("/v1/completions", {
                 "model": "base", "prompt": [AGGRESSOR * 8] * 16, "echo": True, "logprobs": 20, "max_tokens": 0})}
    result["heavy_single_requests"] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys['aggressor']}"}, timeout=600) as c:
        for name, (path, body) in heavy.items():
            with _Probe(url) as probe:
                started = time.perf_counter()
                status = c.post(path, json=body).status_code
                took = time.perf_counter() - started
            result["heavy_single_requests"][name] = {"status": status, "seconds": round(took, 2),
                                                     "healthz": _ms(probe.times)}
    healthz = [result[p]["healthz"]["p99_ms"] for p in ("anonymous_aggressor", "keyed_aggressor")] + \
              [r["healthz"]["p99_ms"] for r in result["heavy_single_requests"].values()]
    result["bars"] = {
        "victim p50 <= 2x alone": all(result[p]["victim_p50_over_alone"] <= 2
                                      for p in ("anonymous_aggressor", "keyed_aggressor")),
        "victim p99 <= 3x alone": all(result[p]["victim_p99_over_alone"] <= 3
                                      for p in ("anonymous_aggressor", "keyed_aggressor")),
        "/healthz p99 <= 50 ms": max(healthz) <= 50}
    return result
