"""`/metrics` in Prometheus' text format (prometheus_client), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine import GenerationResult

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
MAX_POSITION = 16  # accepted-by-position counts beyond this draft position are lumped into it


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdecode_requests",
                                "Answers by endpoint and HTTP status (499: the client left first)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("specdecode_cached_prompt_tokens", "Prompt tokens of finished requests "
                                            "taken from another sequence's cache, not fed", registry=r)
        self.generated_tokens = Counter("specdecode_generated_tokens", "Tokens generated", ["method"], registry=r)
        self.target_forwards = Counter("specdecode_target_forwards", "Target forwards (steps)", ["method"], registry=r)
        self.drafted = Counter("specdecode_drafted_tokens", "Draft tokens proposed", ["method"], registry=r)
        self.accepted = Counter("specdecode_accepted_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.accepted_by_position = Counter(
            "specdecode_accepted_by_position", "Steps whose draft was accepted at least to this position (1-based)",
            ["method", "position"], registry=r)
        self.cancelled = Counter("specdecode_cancelled_requests", "Generations stopped because the client left",
                                 registry=r)
        self.expired = Counter("specdecode_expired_requests", "Generations ended at the request deadline", registry=r)
        self.latency = Histogram("specdecode_request_seconds", "From arrival to the last token", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("specdecode_time_to_first_token_seconds", "From arrival to the first token",
                                     ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("specdecode_queue_seconds", "Waiting for the model", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.batch_size = Histogram("specdecode_batch_size", "Sequences per batched target forward",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.batch_drafted = Counter("specdecode_batch_drafted_tokens", "Draft tokens verified in batched forwards",
                                     ["batch_size"], registry=r)
        self.batch_forwards = Counter("specdecode_batch_forwards", "Batched target forwards", ["batch_size"],
                                      registry=r)
        self.waiting = Gauge("specdecode_waiting_requests", "Requests queued for the model (being tokenized or "
                             "waiting for the worker)", registry=r)
        self.running = Gauge("specdecode_running_requests", "Requests being generated", registry=r)
        self.prefix_cache = Gauge("specdecode_prefix_cache_bytes", "Ended requests' keys and values the batch keeps "
                                  "copied for later prompts that begin as they do (--prefix-cache-gib)", registry=r)

    def finished(self, result: GenerationResult, seconds: float) -> None:
        method = result.method
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.cached_prompt_tokens.inc(result.cached_tokens)
        self.generated_tokens.labels(method).inc(result.new_tokens)
        self.target_forwards.labels(method).inc(result.target_forwards)
        self.drafted.labels(method).inc(sum(s.drafted for s in result.steps))
        self.accepted.labels(method).inc(sum(s.accepted for s in result.steps))
        for step in result.steps:
            for position in range(1, min(step.accepted, MAX_POSITION) + 1):
                self.accepted_by_position.labels(method, str(position)).inc()
        self.latency.labels(method).observe(seconds)

    def batch_step(self, size: int, drafted: int) -> None:
        """One batched forward of `size` sequences that verified `drafted` draft tokens in all."""
        self.batch_size.observe(size)
        self.batch_forwards.labels(str(size)).inc()
        self.batch_drafted.labels(str(size)).inc(drafted)

    def text(self) -> bytes:
        return generate_latest(self.registry)
