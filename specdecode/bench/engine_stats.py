"""The speculative figures an OpenAI-compatible engine publishes, read where each engine puts them, as one
`ServerStats`. Pure functions of what the engine sent (a response's fields, `/metrics` text, a server-info
JSON), so each is tested on recorded samples without the engine (tests/fixtures/).

Vocabulary, in every engine's terms mapped to ours (`specdecode.metrics`):
- *drafts*: verification steps that carried a draft (vLLM's `num_drafts`);
- *drafted*: draft tokens proposed; *accepted*: draft tokens the target kept, the bonus token not counted;
- *mean acceptance length*: tokens a verification step emits, the bonus token included (vLLM's and
  SGLang's convention: 1 + accepted / drafts; ours: new tokens / target forwards, the prefill included).

Where each engine publishes them:
- ours (`specdecode serve`): the `speculative` field of each response (the last streamed chunk): one
  request's own figures, exact under any load;
- llama.cpp's llama-server: `timings.draft_n` and `timings.draft_n_accepted` of each response (the last
  chunk), present only when the request drafted (tools/server/server-task.cpp, `result_timings::to_json`);
- vLLM: Prometheus counters on `/metrics` (vllm/v1/spec_decode/metrics.py, `SpecDecodingProm`):
  `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos{position="i"}` (0-based), `_total` in the text format, one series per
  engine core; a request's figures are the difference of two readings around it (other requests' too,
  when several run at once);
- SGLang: `internal_states[i].avg_spec_accept_length` of `/get_server_info`: accepted tokens (bonus
  included) over verification forwards since the server started (python/sglang/srt/managers/scheduler.py,
  `get_internal_state`). An average, not counters: two readings cannot be differenced, so the reading after
  the run stands for the whole server lifetime (start SGLang afresh for a run's own figure).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

VLLM_PREFIX = "vllm:spec_decode_"


@dataclass
class ServerStats:
    """What an engine says about the speculative decoding of some requests (None: it does not say)."""

    source: str  # where the figures come from, for the report
    drafts: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at least to position i + 1
    forwards: int | None = None  # target forwards (ours), the prefill included
    new_tokens: int | None = None  # what `forwards` produced (ours)
    mean_acceptance_length: float | None = None  # given as such (SGLang), not derived

    def __add__(self, other: ServerStats) -> ServerStats:
        def add(a, b):
            return None if a is None or b is None else a + b

        positions = [a + b for a, b in zip(self.accepted_by_position, other.accepted_by_position)]
        longer = max(self.accepted_by_position, other.accepted_by_position, key=len)
        return ServerStats(
            self.source, add(self.drafts, other.drafts), add(self.drafted, other.drafted),
            add(self.accepted, other.accepted), positions + longer[len(positions):], add(self.forwards, other.forwards),
            add(self.new_tokens, other.new_tokens), other.mean_acceptance_length,  # an average: the latest reading
        )

    def minus(self, before: ServerStats) -> ServerStats:
        """Counters read after some requests less those read before them."""

        def sub(a, b):
            return None if a is None or b is None else a - b

        width = max(len(self.accepted_by_position), len(before.accepted_by_position))
        after_positions = self.accepted_by_position + [0] * (width - len(self.accepted_by_position))
        before_positions = before.accepted_by_position + [0] * (width - len(before.accepted_by_position))
        return ServerStats(self.source, sub(self.drafts, before.drafts), sub(self.drafted, before.drafted),
                           sub(self.accepted, before.accepted),
                           [a - b for a, b in zip(after_positions, before_positions)],
                           sub(self.forwards, before.forwards), sub(self.new_tokens, before.new_tokens),
                           self.mean_acceptance_length)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted and self.accepted is not None else None

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification step, the bonus token included."""
        if self.mean_acceptance_length is not None:
            return self.mean_acceptance_length
        if self.forwards and self.new_tokens is not None:
            return self.new_tokens / self.forwards
        if self.drafts and self.accepted is not None:
            return 1 + self.accepted / self.drafts
        return None

    @property
    def accepted_per_position(self) -> list[float]:
        """Per draft position, the share of drafts accepted at least that far (vLLM's per-position rate)."""
        return [count / self.drafts for count in self.accepted_by_position] if self.drafts else []

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict) -> ServerStats:
        return cls(**data)


def from_specdecode(speculative: dict, new_tokens: int) -> ServerStats:
    """Our server's `speculative` field (`serve.protocol.speculative`): one request's own figures."""
    return ServerStats("specdecode `speculative` field", drafted=speculative["drafted_tokens"],
                       accepted=speculative["accepted_tokens"], forwards=speculative["target_forwards"],
                       new_tokens=new_tokens)


def from_llama_timings(timings: dict) -> ServerStats:
    """llama-server's `timings` of one response; without `draft_n` the request drafted nothing."""
    return ServerStats("llama-server `timings`", drafted=int(timings.get("draft_n", 0)),
                       accepted=int(timings.get("draft_n_accepted", 0)))


def from_vllm_metrics(text: str, model: str | None = None) -> ServerStats | None:
    """vLLM's spec-decode counters in a `/metrics` page, summed over engine cores (series of `model` only,
    when given and labelled); None when the page has none (speculative decoding off, or not vLLM)."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(VLLM_PREFIX) or sample.name.endswith("_created"):
                continue
            if model is not None and sample.labels.get("model_name", model) != model:
                continue
            name = sample.name.removeprefix(VLLM_PREFIX).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                positions[position] = positions.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    if "num_drafts" not in totals:
        return None
    return ServerStats("vLLM /metrics", drafts=int(totals["num_drafts"]),
                       drafted=int(totals.get("num_draft_tokens", 0)),
                       accepted=int(totals.get("num_accepted_tokens", 0)),
                       accepted_by_position=[int(positions.get(i, 0)) for i in range(len(positions))])


def from_sglang_server_info(info: dict) -> ServerStats | None:
    """SGLang's `/get_server_info`: the mean of `avg_spec_accept_length` over its data-parallel ranks that
    report one; None when none does (speculative decoding off, nothing decoded yet, or not SGLang)."""
    states = info.get("internal_states")
    if not isinstance(states, list):
        return None
    lengths = [s["avg_spec_accept_length"] for s in states
               if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), (int, float))]
    if not lengths:
        return None
    return ServerStats("SGLang /get_server_info (since the server started)",
                       mean_acceptance_length=sum(lengths) / len(lengths))
