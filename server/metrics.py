"""Prometheus metrics (prometheus-client), one registry per app so several apps can live in a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        self.requests = Counter("lethe_requests", "HTTP requests", ["path", "status"], registry=r)
        self.tokens = Counter("lethe_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("lethe_queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_size = Histogram("lethe_batch_size", "Requests decoded together",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.profile_requests = Counter("lethe_profile_requests", "Generation requests per profile",
                                        ["profile"], registry=r)
        self.job_seconds = Histogram("lethe_job_duration_seconds", "Training job durations", ["kind", "status"],
                                     buckets=(1, 5, 15, 60, 300, 1800), registry=r)
