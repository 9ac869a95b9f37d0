"""What clients read, checked piece by piece without a model, where a mutation review found that no end-to-end test
would see a plausible mistake (the tiny models never write the case): a single `stop` string, parallel calls streamed
in two steps, an echoed completion's streamed offsets, the usage and rate of several choices, a token whose text a
likelier one shares, `max_tokens` of the whole context; the Responses API's items, statuses, cached tokens and failure
codes; the benchmark's time to the first token and its decoding-only speedup."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from specdecode.bench import event_stream, report
from specdecode.bench.harness import Record
from specdecode.serve import logprobs, protocol, replies
from specdecode.serve.limits import Limits
from specdecode.serve.logprobs import TokenTexts
from specdecode.serve.protocol import APIError, CompletionRequest, parse
from specdecode.serve.response_objects import Events, ResponsesReply
from specdecode.serve.tools import QWEN25, ToolUse
from specdecode.types import TokenLogprob

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>\n'


class Letters:
    """A tokenizer whose token t reads as one letter, one byte."""

    def decode(self, ids, **_):
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def convert_ids_to_tokens(self, token):
        return self.decode([token])


def step(text: str, ids=(), scores=None):
    """A streamed step as `replies.Chunks.step` reads it."""
    event = NS(text=text, token_ids=list(ids), logprobs=scores, origins=[], stats=NS(drafted=0, accepted=0))
    return NS(event=event, pieces=[], rejected_text="")


def test_a_single_stop_string_is_one_stop_string():
    """OpenAI's `stop` may be one string: that string, not its characters (each of which would end the answer)."""
    body = parse(json.dumps({"model": "m", "prompt": "hi", "stop": "\n\nQ:"}).encode(), CompletionRequest)
    assert body.stop == ["\n\nQ:"]


def test_max_tokens_of_the_whole_context_is_refused_naming_max_tokens():
    body = parse(json.dumps({"model": "m", "prompt": "hi", "max_tokens": 256}).encode(), CompletionRequest)
    with pytest.raises(APIError) as refused:
        Limits().answer_limit(body, 256)
    assert refused.value.param == "max_tokens" and refused.value.code == "context_length_exceeded"


def test_parallel_calls_streamed_in_two_steps_are_numbered_across_chunks():
    """A client merges streamed call deltas by `index`: the second call's, closing a step later, is 1 (0 again would
    glue its arguments onto the first's)."""
    use = ToolUse((WEATHER,), "auto", True, QWEN25)
    writer = replies.Chunks(replies.Answer(chat=True, model_name="m", tools=use))
    indices = []
    for piece in (CALL % "Paris", CALL % "Oslo"):
        _, *calls = writer.step(step(piece))
        indices += [c[0]["delta"]["tool_calls"][0]["index"] for c in calls]
    assert indices == [0, 1]


def test_a_streamed_echoed_completions_offsets_start_after_the_prompt():
    writer = replies.Chunks(replies.Answer(chat=False, model_name="m", texts=TokenTexts(Letters()), echo="abc"))
    [[choice]] = writer.step(step("d", [3], [TokenLogprob(3, -0.5, ((3, -0.5),))]))
    assert choice["logprobs"]["text_offset"] == [3]


def result(prompt: int, new: int, cached: int):
    return NS(prompt_ids=[0] * prompt, new_tokens=new, cached_tokens=cached, token_ids=[0] * new)


def test_several_choices_count_their_prompt_and_its_cached_tokens_once_and_their_rate_side_by_side():
    plan = replies.Choices([replies.Answer(chat=True, model_name="m")] * 3, [0, 1, 2])
    usage = plan.usage([result(10, 4, 8), result(10, 5, 8), result(10, 6, 8)])
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == 15
    assert usage["prompt_tokens_details"]["cached_tokens"] == 8
    runs = [NS(steps=[], method="ar", new_tokens=10, seconds=1.0) for _ in range(2)]  # (decoded side by side)
    assert protocol.speculative(runs)["tokens_per_second"] == 20.0


def test_a_completions_top_logprobs_give_a_token_its_own_figure_where_a_likelier_one_reads_the_same():
    texts = NS(text=lambda t: "x", bytes=lambda t: [0x78])
    entry = TokenLogprob(6, -2.0, ((5, -1.0), (6, -2.0)))
    out = logprobs.completion_entries([entry], [6], logprobs.Offsets(texts))
    assert out["top_logprobs"] == [{"x": -2.0}] and out["token_logprobs"] == [-2.0]


def generation(text: str, finish: str, prompt=5, new=7, cached=0):
    return NS(text=text, finish_reason=finish, prompt_ids=[0] * prompt, new_tokens=new, cached_tokens=cached,
              token_ids=[0] * new, steps=[], seconds=1.0, method="ar", prompt_logprobs=None)


def whole(text: str, finish: str, tools=None, **kwargs) -> dict:
    """The Response of a generation that wrote `text`."""
    use = None if tools is None else ToolUse(tuple(tools), "auto", True, QWEN25)
    echoed = {"tools": tools or [], "tool_choice": "auto", "parallel_tool_calls": True}
    plan = replies.Choices([replies.Answer(chat=True, model_name="m", tools=use)], [0])
    return ResponsesReply(echoed, lambda p: p).whole([(generation(text, finish, **kwargs), [])], plan)


def streamed(chunks: list) -> list[dict]:
    """The events' data of a stream of chat chunks, its end (None) last."""
    events = Events(ResponsesReply({"tools": [], "tool_choice": "auto"}, lambda p: p), "m")
    return [json.loads(e.split("data: ", 1)[1]) for chunk in chunks for e in events.read(chunk)]


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def test_a_responses_usage_carries_the_cached_prompt_tokens():
    assert whole("Hello.", "eos", prompt=12, cached=8)["usage"]["input_tokens_details"]["cached_tokens"] == 8


def test_text_before_a_call_the_limit_cut_is_a_completed_message_and_an_incomplete_call():
    response = whole('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "length", tools=[WEATHER])
    assert response["status"] == "incomplete"
    assert [(item["type"], item["status"]) for item in response["output"]] == [
        ("message", "completed"), ("function_call", "incomplete")]


def test_an_empty_answer_is_one_empty_message_whole_and_streamed():
    final = streamed([chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), None])[-1]["response"]
    assert [item["type"] for item in whole("", "eos", new=1)["output"]] == ["message"]
    assert [item["type"] for item in final["output"]] == ["message"]


def test_a_message_item_is_done_before_the_next_call_item_is_added():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    events = streamed([chunk({"content": "Let me add."}), chunk({"tool_calls": [call]}), chunk({}, "tool_calls"),
                       None])
    items = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item")]
    assert items == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]


@pytest.mark.parametrize(("kind", "code"), [("server_error", "server_error"), ("invalid_request_error",
                                                                                "invalid_prompt")])
def test_a_failure_mid_stream_says_whose_it_is(kind, code):
    error = {"error": {"message": "x", "type": kind, "param": None, "code": None}}
    assert streamed([error])[-1]["response"]["error"]["code"] == code


def test_the_benchmarks_decoding_speedup_counts_the_tokens_after_each_turns_first():
    """(50 - 1) tokens in 0.5 s against (100 - 1) in 1 s: 0.99x (counting the first token too reads 1.00x; lossless
    rows, with the same counts, cannot tell)."""
    records = [Record("ar", "code", "t", 0, token_ids=[1] * 100, turn_lengths=[100], seconds=2.0, prefill_seconds=1.0),
               Record("m", "code", "t", 0, token_ids=[1] * 50, turn_lengths=[50], seconds=1.5, prefill_seconds=1.0)]
    summaries = {s.method: s for s in report.summarise(records, {"ar": True, "m": False})}
    assert summaries["m"].cells[report.OVERALL].decode_speedup[0] == pytest.approx(98 / 99)


def test_the_benchmarks_time_to_first_token_is_per_turn():
    """An engine's two-turn task, 2 s to the turns' first tokens in all: 1 s each, then 1 s for the 18 after."""
    record = Record("eng", "chat", "t", 0, token_ids=[1] * 20, turn_lengths=[10, 10], seconds=3.0, prefill_seconds=2.0,
                    engine_prompt_tokens=[0, 0], prompt_ids=[[], []])
    [summary] = report.summarise([record], {"eng": False}, reference_name="eng")
    assert summary.first_token_seconds == pytest.approx(1.0)
    assert summary.inter_token_seconds == pytest.approx(1 / 18)


def test_an_engines_first_token_is_timed_at_its_first_piece(monkeypatch):
    """The clock reads the second that the line being read arrived in: the first piece's, 1 s."""
    lines = [b"data: " + json.dumps(each).encode() + b"\n" for each in (
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})]
    now = [0.0]

    class Response:
        headers = NS(get_content_type=lambda: "text/event-stream")

        def __iter__(self):
            for second, line in enumerate(lines, 1):
                now[0] = float(second)
                yield line

    monkeypatch.setattr(event_stream.time, "perf_counter", lambda: now[0])
    answer = event_stream.read(Response(), "x", "http://h", 0.0, float("inf"))
    assert answer.first == 1.0 and answer.pieces == ["a", "b"]


@pytest.mark.parametrize("cuts", [(), (5,), (14, 40), tuple(range(1, 120, 7)), tuple(range(1, 120))])
def test_a_streamed_responses_items_are_the_whole_ones_wherever_the_steps_fall(cuts):
    """Text, a call, text again: one message item with all the text, then the call, whole or streamed, whether the
    call and the text after it come in one step (a speculative one) or several (plain decoding's)."""
    text = "Let me check. " + CALL % "Oslo" + "It is sunny."
    use = ToolUse((WEATHER,), "auto", True, QWEN25)
    writer = replies.Chunks(replies.Answer(chat=True, model_name="m", tools=use))
    pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text))) if a < b]
    chunks = [{"choices": choice} for piece in pieces for choice in writer.step(step(piece))]
    chunks += [{"choices": choice} for choice in writer.last(NS(finish_reason="eos"))] + [None]
    events = Events(ResponsesReply({"tools": [WEATHER], "tool_choice": "auto"}, lambda error: error), "m")
    final = [json.loads(e.split("data: ", 1)[1]) for chunk in chunks for e in events.read(chunk)][-1]["response"]
    expected = whole(text, "eos", tools=[WEATHER])
    assert [(i["type"], i.get("status")) for i in final["output"]] == [(i["type"], i.get("status"))
                                                                        for i in expected["output"]]
    assert final["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    assert [i.get("arguments") for i in final["output"]] == [i.get("arguments") for i in expected["output"]]
