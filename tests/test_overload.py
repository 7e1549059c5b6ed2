"""Overload, in a short form of `lethe bench soak`: busy answers instead of growing memory or failing."""

from lethe.heads.modelio import load_model
from live_server import new_tenant, running_server
from lethe.server.bench.soak import soak


def test_short_soak_answers_429_with_retry_after_frees_leavers_and_serves_past_a_slow_client(tiny_model_dir,
                                                                                             tmp_path):
    with running_server(load_model(tiny_model_dir), tmp_path, max_queue=2, max_batch_size=4,
                        metrics_public=True) as url:
        slow = new_tenant(url, "slow-reader").headers["authorization"].removeprefix("Bearer ")
        # the anonymous callers fill the queue; the slow reader, a tenant of its own, still gets its part of it
        result = soak(url, clients=12, duration=6.0, max_new_tokens=24, leavers=2, slow_readers=1,
                      slow_reader_key=slow)
    assert result["served"] > 20 and result["healthy_after"]
    assert set(result["errors"]) == {"429"}, result["errors"]  # busy, never a 5xx or a dropped connection
    assert result["rate_limited_without_retry_after"] == 0
    assert result["left_early"] > 0 and result["slow_reader_events"] >= 2
    assert result["p99_s"] < 5.0, "a slow reader does not hold the others up"
    assert result["rss_peak_mb"] - result["rss_start_mb"] < 300, result
