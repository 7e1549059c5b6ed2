"""Prometheus metrics (prometheus-client), one registry per app so several apps can live in a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

# no `_created` series: a counter's creation time would tell when a kind of activity (a first profile request, a
# first job) began
disable_created_metrics()


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def profile_kind(resolved) -> str:
    """`base`, `named` (a stored profile: it has a version) or `inline`: a bounded label with no tenant data."""
    if resolved.name is None:
        return "inline"
    return "named" if resolved.version is not None else "base"


class Metrics:
    """Labels are bounded and carry no tenant data: `path` is a route template (or `unmatched`), `status` an
    HTTP status, `kind` a fixed word."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        self.requests = Counter("lethe_requests", "HTTP requests", ["path", "status"], registry=r)
        self.tokens = Counter("lethe_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("lethe_queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_size = Histogram("lethe_batch_size", "Requests decoded together",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        # by kind, never by name: profile names are tenants' data, and a label per name grows without bound
        self.profile_requests = Counter("lethe_profile_requests", "Generation requests by kind of profile",
                                        ["kind"], registry=r)
        self.request_seconds = Histogram("lethe_request_duration_seconds",
                                         "Time to the response's start (its headers), per route template",
                                         ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_seconds = Histogram("lethe_time_to_first_token_seconds",
                                             "From a generation request's submission to its first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.running_rows = Histogram("lethe_running_rows", "Rows decoded in one decoding step",
                                      buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.job_seconds = Histogram("lethe_job_duration_seconds", "Training job durations", ["kind", "status"],
                                     buckets=(1, 5, 15, 60, 300, 1800), registry=r)
        # what anyone may read where LETHE_METRICS_PUBLIC is on: serving load, not tenants' activity (jobs, profile
        # use); the admin key reads `registry`, all of it
        self.public = CollectorRegistry()
        for collector in (self.requests, self.tokens, self.queue_depth, self.batch_size, self.request_seconds,
                          self.first_token_seconds, self.running_rows):
            self.public.register(collector)
        ProcessCollector(registry=self.public)

    def count_profile(self, resolved) -> None:
        self.profile_requests.labels(profile_kind(resolved)).inc()
