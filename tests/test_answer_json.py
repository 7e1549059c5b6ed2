"""Large answers are encoded a slice at a time (`server/answer_json.py`): the same bytes as one `json.dumps`
call, while the event loop keeps answering."""

import json
import random
import threading
import time

from lethe.server.answer_json import dumps


def _reference(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _random(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([None, True, False, 0, -3, 1.5e-7, float(rng.random())])
    if kind == 1:
        return rng.choice(["", "é\u00e9 \"q\" \\ \n", "Paris", "\u4e2d\u6587", "😀"])
    if kind == 2:
        return rng.randrange(-10**6, 10**6)
    if kind == 3:
        return []
    if kind in (4, 5):
        return [_random(rng, depth + 1) for _ in range(rng.choice([1, 3, 70, 130] if depth < 2 else [1, 3]))]
    return {f"k{i} é": _random(rng, depth + 1) for i in range(rng.choice([1, 2, 5]))}


def test_the_bytes_are_json_dumps_bytes():
    rng = random.Random(0)
    for _ in range(200):
        value = _random(rng)
        assert dumps(value) == _reference(value)
    answer = {"id": "cmpl-1", "choices": [{"index": i, "text": "x", "logprobs": {
        "tokens": [" a"] * 300, "token_logprobs": [None] + [-0.5] * 299, "text_offset": list(range(300)),
        "top_logprobs": [None] + [{f" t{j}": -float(j) for j in range(20)} for _ in range(299)]}} for i in range(16)]}
    assert dumps(answer) == _reference(answer)
    ids = {"tokens": [rng.randrange(50_000) for _ in range(10_000)], "count": 10_000, "empty": [], "one": [1.5]}
    assert dumps(ids) == _reference(ids)  # long flat lists are sliced too


def test_a_large_answer_leaves_other_threads_running():
    """One json.dumps over a multi-megabyte answer holds the GIL throughout; `dumps` lets a waiting thread in
    every few milliseconds."""
    answer = {"choices": [{"logprobs": {"top_logprobs": [{f" tok{j}": -float(j) / 3 for j in range(20)}
                                                         for _ in range(2000)]}} for _ in range(16)]}
    gaps, done = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    def longest_gap(encode, tries: int = 3) -> float:
        """The least, over a few tries, of the longest pause: another process on the cores only adds to a pause, so
        the least is the encoder's own (a loaded machine once stretched a single try to 33 ms)."""
        longest = []
        for _ in range(tries):
            gaps.clear()
            done.clear()
            thread = threading.Thread(target=ticker)
            thread.start()
            time.sleep(0.05)
            encode(answer)
            done.set()
            thread.join()
            longest.append(max(gaps))
        return min(longest)

    whole, sliced = longest_gap(_reference), longest_gap(dumps)
    print(f"longest pause of another thread: {1000 * whole:.0f} ms with json.dumps, {1000 * sliced:.0f} ms sliced")
    assert sliced < 0.03 and sliced < whole / 2, (whole, sliced)
    # /tokenize's answer for 1 MB: 200,000 ids in one flat list (one call held the GIL for 60 ms)
    answer = {"tokens": list(range(1_000_000, 1_400_000)), "count": 400_000, "max_model_len": 8192}
    whole, sliced = longest_gap(_reference), longest_gap(dumps)
    print(f"a flat list: {1000 * whole:.0f} ms with json.dumps, {1000 * sliced:.0f} ms sliced")
    assert sliced < 0.03 and sliced < whole / 2, (whole, sliced)
