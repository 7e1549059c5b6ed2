"""Fair serving: no caller's backlog delays another tenant's request by more than about one row's turn, a full
queue refuses the caller that fills it and not the others, and each tenant's rows are admitted least served first
(`server/scheduler.py`)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from lethe.heads.decoding.sampling import SamplingParams
from lethe.server.engine import Engine, Pending
from lethe.server.scheduler import FairQueue, QueueFull, pick
from live_server import new_tenant, running_server


@dataclass
class Item:
    tenant: str | None
    submitted: float = field(default_factory=time.perf_counter)


def _queues(**backlogs: int) -> dict:
    return {t: deque(Item(t) for _ in range(n)) for t, n in backlogs.items()}


def test_a_tenant_alone_fills_the_batch_but_for_a_reserve_and_a_newcomer_joins_at_once():
    waiting = _queues(a=40)
    assert len(pick(waiting, Counter(), room=16, max_batch=16)) == 14  # 2 rows are kept for whoever comes next
    assert pick(waiting, Counter(a=14), room=2, max_batch=16) == []
    waiting["b"] = deque([Item("b"), Item("b")])
    # b is below its part (16 // 3): it takes the kept rows; a, far above its part, gets none of them
    assert [i.tenant for i in pick(waiting, Counter(a=14), room=2, max_batch=16)] == ["b", "b"]
    # rows a frees go to b while b is below its part, even with a's older requests waiting
    waiting["b"].extend(Item("b") for _ in range(5))
    assert [i.tenant for i in pick(waiting, Counter(a=10, b=2), room=4, max_batch=16)] == ["b", "b", "b"]
    assert len(pick(_queues(a=40), Counter(), room=16, max_batch=16, per_caller=4)) == 4  # the operator's cap


def test_the_queue_gives_a_lone_tenant_half_the_batch_unless_the_operator_allows_more():
    for per_caller, rows in ((None, 8), (12, 12), (16, 14)):
        queue = FairQueue(max_batch=16, max_queue=64, per_caller=per_caller)
        for _ in range(40):
            queue.put(Item("a"))
        assert len(queue.take(block=False, room=16, active=[])) == rows
        queue.put(Item("b"))
        assert [i.tenant for i in queue.take(block=False, room=16 - rows, active=["a"] * rows)][:1] == ["b"]


def test_free_rows_go_to_the_least_served_tenant_first():
    waiting = _queues(a=20, b=20, c=1)
    picked = pick(waiting, Counter(a=5, b=2), room=5, max_batch=16)
    # c first, then b up to its part of 16 // (3 + 1); a already holds more than that and gets nothing, and the
    # 2 rows left are kept free
    assert [i.tenant for i in picked] == ["c", "b", "b"]
    # with more room, rows beyond the parts go least served first, the 2 kept rows aside
    picked = pick(_queues(a=20, b=20, c=1), Counter(a=5, b=2), room=9, max_batch=16)
    assert [i.tenant for i in picked] == ["c", "b", "b", "b", "a", "b", "a"]


def test_small_batches_keep_no_reserve_and_still_serve_one_row_a_caller():
    assert len(pick(_queues(a=10), Counter(), room=4, max_batch=4)) == 4
    assert len(pick(_queues(a=10), Counter(), room=1, max_batch=1)) == 1
    assert pick(_queues(a=10, b=1), Counter(a=1), room=0, max_batch=1) == []
    assert [i.tenant for i in pick(_queues(a=10, b=1), Counter(a=3), room=1, max_batch=4)] == ["b"]


def test_a_full_queue_refuses_the_caller_holding_it_not_the_others():
    queue = FairQueue(max_batch=4, max_queue=4)
    for _ in range(4):
        queue.put(Item("a"))
    with pytest.raises(QueueFull, match="4 of them this caller's"):
        queue.put(Item("a"))
    queue.put(Item("b"))  # b holds nothing waiting: admitted beyond the bound
    queue.put(Item(None))  # anonymous callers are one more tenant
    with pytest.raises(QueueFull):
        queue.put(Item("b"))  # b's part of 4 among three tenants is 1
    assert queue.qsize() == 6


def test_one_tenants_backlog_does_not_hold_up_another_tenants_short_request(tiny_lm):
    """32 long requests of one tenant (as many as it may have in flight), then one short request of another:
    the short one ends before any long one does. First come, first served made it wait for 16 long ones."""
    engine = Engine(tiny_lm, max_batch_size=8)
    try:
        long = SamplingParams(max_new_tokens=96, temperature=1.0, seed=1, ignore_eos=True)
        decoding = threading.Event()  # set at the first long row's first token: rows are decoding, none has ended
        flood = [engine.submit(Pending("Question: Who is Ada?\nAnswer:", long, tenant="a",
                                       on_text=(lambda text, logprobs: decoding.set()) if i == 0 else None))
                 for i in range(32)]
        assert decoding.wait(timeout=120)
        short = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
        victim = engine.submit(Pending("Question: Where?\nAnswer:", short, tenant="b"))
        victim.future.result(timeout=120)
        ended_before = sum(p.future.done() for p in flood)
        for p in flood:
            p.future.result(timeout=300)
    finally:
        engine.close()
    assert ended_before == 0


def test_anonymous_flood_gets_429_while_a_tenant_is_served(tiny_lm, tmp_path):
    """Anonymous callers fill the queue (429 with Retry-After once they hold it); a tenant's requests meanwhile
    are admitted and answered."""
    with running_server(tiny_lm, tmp_path, max_queue=4, max_batch_size=2, quota_rows=64) as url:
        tenant = new_tenant(url, "victim")
        body = {"model": "base", "prompt": "Question: Who is Ada?\nAnswer:", "max_tokens": 64, "min_tokens": 64}
        stop, codes = threading.Event(), Counter()

        def flood():
            while not stop.is_set():
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                codes[r.status_code] += 1
                if r.status_code == 429:
                    assert r.headers["retry-after"]
                    time.sleep(0.05)

        with ThreadPoolExecutor(12) as pool:
            floods = [pool.submit(flood) for _ in range(12)]
            time.sleep(1.0)
            served = [tenant.post("/generate", json={"prompt": "Question: Where?\nAnswer:", "max_new_tokens": 4})
                      for _ in range(3)]
            stop.set()
            for f in floods:
                f.result()
    assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
    assert codes[429] > 0 and codes[200] > 0, codes


def test_the_fairness_bench_reports_each_phase_with_healthz_probed_from_its_own_process(tiny_lm, tmp_path):
    """A short `lethe bench fairness` run: every phase has victim latencies and /healthz readings (taken by a probe
    process of its own), the aggressors got answers, and the bars are reported."""
    from lethe.server.bench.fairness import bench_fairness
    from live_server import ADMIN_KEY

    with running_server(tiny_lm, tmp_path, quota_rows=4, max_batch_size=4) as url:
        result = bench_fairness(url, ADMIN_KEY, rows=4, victim_requests=3, victim_tokens=2, aggressor_tokens=16,
                                warm_up=0.5)
    for phase in ("alone", "anonymous_aggressor", "keyed_aggressor"):
        assert result[phase]["victim"]["n"] == 3 and result[phase]["healthz"]["n"] >= 1, result[phase]
    assert result["anonymous_aggressor"]["aggressor_answers"] and result["keyed_aggressor"]["aggressor_answers"]
    heavy = result["heavy_single_requests"]
    assert heavy["tokenize_1mb"]["status"] == 200  # (the echo's 16 long prompts exceed the tiny model's context)
    assert all(h["healthz"]["n"] >= 1 for h in heavy.values()), heavy
    assert set(result["bars"]) == {"victim p50 <= 2x alone", "victim p99 <= 3x alone", "/healthz p99 <= 50 ms"}
