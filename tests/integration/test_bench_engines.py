"""OpenAI-compatible engines as benchmark rows (`bench.openai_engines`): the --engine syntax, the parsers of
each engine's speculative figures on recorded samples (tests/fixtures/), and for real on loopback: our own
`specdecode serve` and, where it is built, llama.cpp's llama-server plain, with a draft model and n-gram."""

from __future__ import annotations

import email.message
import http.client
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TOKENS, noisy_copy, tiny_chat_qwen2, tiny_tokenizer, write_tiny_gguf
from specdecode.api import load_models
from specdecode.bench import engine_stats, event_stream, report
from specdecode.bench.datasets import Task
from specdecode.bench.harness import run_benchmark
from specdecode.bench.openai_engines import build_engines, parse_engine, run_levels
from specdecode.bench.runners import build_runners
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.serve.app import Server, ServerThread, create_app
from specdecode.serve.guard import Guard

pytestmark = pytest.mark.usefixtures("one_thread")
FIXTURES = Path(__file__).parents[1] / "fixtures"
TASKS = [Task("a", "a/1", ("the cat sat",)), Task("a", "a/2", ("the the", "and again")), Task("b", "b/1", ("hello",))]
CONFIG = GenerationConfig(max_new_tokens=10)


# --- the option's syntax -------------------------------------------------------------------------------

def test_engine_option_syntax():
    spec = parse_engine('llama-draft=openai:http://127.0.0.1:8081/v1/;model=x;extra_body={"n_probs":0,"a":"b;c"};'
                        "reference=llama;api=chat")
    assert (spec.label, spec.url, spec.model, spec.api, spec.reference) == ("llama-draft", "http://127.0.0.1:8081/v1",
                                                                           "x", "chat", "llama")
    assert spec.extra_body == {"n_probs": 0, "a": "b;c"} and spec.root == "http://127.0.0.1:8081"
    assert parse_engine("ours=openai:http://h:1/v1").model is None
    for bad, says in [("openai:http://h/v1", "expected"), ("x=http://h/v1", "expected"),
                      ("x y=openai:http://h", "label"),
                      ("x=openai:h:8080", "URL"), ("x=openai:http://h/v1;modle=m", "unknown field 'modle'"),
                      ("x=openai:http://h/v1;extra_body={bad", "JSON"),
                      ("x=openai:http://h/v1;extra_body=[1]", "object"),
                      ("x=openai:http://h/v1;api=grpc", "api"), ("x=openai:http://h/v1;stats=x", "stats"),
                      ('x=openai:http://h/v1;extra_body={"n":2}', "asks for several answers"),
                      ("x=openai:http://h/v1;timeout=-1", "timeout is a request's limit")]:
        with pytest.raises(UserError, match=says):
            parse_engine(bad)


def test_an_unreachable_engine_is_one_clear_error():
    with pytest.raises(UserError, match="cannot reach http://127.0.0.1:9/v1/models"):
        build_engines(["gone=openai:http://127.0.0.1:9/v1"], set(), [1, 2])
    with pytest.raises(UserError, match="unique"):
        build_engines(["ar=openai:http://127.0.0.1:9/v1"], {"ar"}, [1, 2])


# --- each engine's figures, parsed from recorded samples ----------------------------------------------

def test_vllm_metrics_sample():
    text = (FIXTURES / "vllm_metrics.txt").read_text()
    stats = engine_stats.from_vllm_metrics(text, "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert (stats.drafts, stats.drafted, stats.accepted) == (400, 1200, 600)  # both engine cores, not the other model
    assert stats.accepted_by_position == [320, 190, 90]
    assert stats.acceptance_rate == 0.5 and stats.acceptance_length == 1 + 600 / 400  # bonus token included
    assert stats.accepted_per_position == [0.8, 0.475, 0.225]
    before = engine_stats.from_vllm_metrics(text.replace("300.0", "290.0"), "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    # 300 -> 290: engine 0's drafts and engine 1's draft tokens
    assert (stats.minus(before).drafts, stats.minus(before).drafted, stats.minus(before).accepted) == (10, 10, 0)
    assert engine_stats.from_vllm_metrics("vllm:num_requests_running 0.0\n") is None  # speculation off


def test_sglang_server_info_sample():
    info = json.loads((FIXTURES / "sglang_server_info.json").read_text())
    stats = engine_stats.from_sglang_server_info(info)
    assert stats.mean_acceptance_length == 2.75 and stats.acceptance_length == 2.75
    assert stats.drafted is None and stats.acceptance_rate is None  # SGLang gives no counts
    assert engine_stats.from_sglang_server_info({"internal_states": [{"last_gen_throughput": 1.0}]}) is None


def test_llama_timings_and_our_field():
    timings = {"prompt_n": 10, "predicted_n": 16, "draft_n": 12, "draft_n_accepted": 9}
    assert engine_stats.from_llama_timings(timings).acceptance_rate == 0.75
    assert engine_stats.from_llama_timings({"prompt_n": 3, "predicted_n": 8}).drafted == 0  # drafted nothing
    ours = engine_stats.from_specdecode({"drafted_tokens": 8, "accepted_tokens": 6, "target_forwards": 5}, 12)
    assert ours.acceptance_length == 12 / 5 and (ours + ours).drafted == 16


# --- our own server on loopback ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def our_server(models):
    state = Server(models, "tiny", default_method="pld", methods=["pld", "ar", "draft"])
    running = ServerThread(create_app(state))
    yield running
    running.stop()


def test_our_server_as_rows_equals_ar(models, our_server):
    """Our server, streamed as the benchmark streams any engine: token counts from usage, the time to the first
    token, its `speculative` figures, and greedy output identical to the `ar` row (ids and text), every turn;
    with the conversation sent to /v1/chat/completions instead, the same (our server templates it as we do)."""
    base = f"{our_server.url}/v1"
    options = [f"ours-pld=openai:{base};model=tiny", f'ours-draft=openai:{base};extra_body={{"method":"draft"}}',
               f"ours-chat=openai:{base};api=chat"]
    engines = build_engines(options, {"ar"}, models.encode_chat([{"role": "user", "content": "Hello"}]))
    runners = build_runners(models, [])
    runners.update({label: engine.runner() for label, engine in engines.items()})
    records = run_benchmark(models, runners, TASKS, CONFIG, repeats=1)
    for r in records:
        assert r.ok, r.error
        assert r.new_tokens == len(r.token_ids) > 0 and len(r.texts) == len(r.turn_lengths)
        if r.method != "ar":
            assert r.ids_known and 0 < r.prefill_seconds < r.seconds
            assert r.server.forwards >= 1 and r.server.drafted is not None
            assert r.engine_prompt_tokens == [len(p) for p in r.prompt_ids]  # it saw our prompts
    summaries = {s.method: s for s in report.summarise(records, {n: True for n in runners})}
    for label in engines:
        assert summaries[label].exact == (3, 3), label
        assert summaries[label].engine and summaries[label].first_token_seconds > 0
    assert summaries["ours-draft"].server.drafted > 0
    text = report.markdown(list(summaries.values()), {}, [])
    assert "Engines over HTTP" in text and "specdecode `speculative` field" in text


def test_agentic_tasks_sent_as_conversations_carry_their_tools(tiny_tool_folder):
    """api=chat sends an agentic task's conversation as OpenAI's API takes it (earlier calls' arguments as JSON
    text) with its tools, so our server renders the prompt we render and answers as `ar` does."""
    from specdecode.bench.samples import sample_tasks

    tooled = load_models(str(tiny_tool_folder), str(tiny_tool_folder), dtype="float32", progress=False)
    running = ServerThread(create_app(Server(tooled, "tiny-tools", default_method="pld", methods=["pld", "ar"])))
    try:
        tasks = [t for t in sample_tasks(["agentic"], None, part="all") if t.task_id.endswith("/2")][:2]
        engines = build_engines([f"chat=openai:{running.url}/v1;api=chat"], {"ar"},
                                tooled.encode_chat([{"role": "user", "content": "Hello"}]))
        runners = build_runners(tooled, []) | {"chat": engines["chat"].runner()}
        records = run_benchmark(tooled, runners, tasks, GenerationConfig(max_new_tokens=6), repeats=1)
    finally:
        running.stop()
    assert len(records) == 4 and all(r.ok for r in records), [r.error for r in records]
    by = {(r.method, r.task_id): r for r in records}
    for task in tasks:
        served, plain = by["chat", task.task_id], by["ar", task.task_id]
        assert served.engine_prompt_tokens == [len(p) for p in served.prompt_ids]  # the tools went with it
        assert served.texts == plain.texts


def test_concurrency_levels_on_our_server(models, our_server):
    engines = build_engines([f"ours=openai:{our_server.url}/v1"], {"ar"}, [1, 2, 3])
    runners = {"ours": engines["ours"].runner()}
    runs = run_levels(models, engines, runners, TASKS, CONFIG, [1, 2], repeats=1)
    assert [(run.engine, run.concurrency) for run in runs] == [("ours", 2)]
    assert all(r.ok and r.concurrency == 2 for r in runs[0].records) and len(runs[0].records) == len(TASKS)
    assert runs[0].new_tokens > 0 and runs[0].server.forwards > 0
    text = report.markdown(report.summarise(runs[0].records, {"ours": True}, "ours"), {}, [], "ours", runs)
    assert "| ours | 2 |" in text


def test_engine_without_usage_is_a_clear_error(models, monkeypatch, our_server):
    """A server whose stream carries no `usage`: refused at the start, in one line."""
    from specdecode.bench import openai_engines

    real = openai_engines.OpenAIEngine._body
    monkeypatch.setattr(openai_engines.OpenAIEngine, "_body",
                        lambda self, config: real(self, config) | {"stream_options": {"include_usage": False}})
    with pytest.raises(UserError, match="no token counts"):
        build_engines([f"x=openai:{our_server.url}/v1"], set(), [1, 2, 3])


def test_a_server_behind_a_key_is_benched_with_the_key_from_the_environment(models, monkeypatch):
    key = "sekrit-sekrit-sekrit-1234"
    running = ServerThread(create_app(Server(models, "tiny", "ar", methods=["ar"]), Guard(api_keys=(key,))))
    try:
        with pytest.raises(UserError, match="HTTP 401"):
            build_engines([f"x=openai:{running.url}/v1"], set(), [1, 2, 3])
        option = f"x=openai:{running.url}/v1;api_key_env=BENCH_TEST_KEY"
        with pytest.raises(UserError, match="BENCH_TEST_KEY, but that environment variable is not set"):
            build_engines([option], set(), [1, 2, 3])
        monkeypatch.setenv("BENCH_TEST_KEY", key)
        engine = build_engines([option], set(), [1, 2, 3])["x"]
        assert engine.complete([1, 2, 3], CONFIG).new_tokens > 0
    finally:
        running.stop()


class Response:
    """A streamed answer as urllib gives it: its content type and its lines (then, maybe, a broken connection)."""

    def __init__(self, lines: list[bytes], kind: str = "text/event-stream", breaks: bool = False):
        self.headers = email.message.Message()
        self.headers["Content-Type"] = kind
        self.lines, self.breaks = lines, breaks

    def __iter__(self):
        yield from self.lines
        if self.breaks:
            raise http.client.IncompleteRead(b"")


def events(*chunks) -> list[bytes]:
    return [b"data: " + json.dumps(chunk).encode() + b"\n" for chunk in chunks]


def text(piece: str, finish=None, ids=None) -> dict:
    choice = {"index": 0, "text": piece, "finish_reason": finish} | ({"token_ids": ids} if ids is not None else {})
    return {"choices": [choice]}


def usage(tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}


@pytest.mark.parametrize("response, says", [
    (Response(events(text("a", "stop"), usage(1))), None),
    (Response(events(text("a"), text("b"), usage(2))), "ended before the answer did (2 tokens arrived"),
    (Response(events(text("a"), usage(1)) + [b"data: [DONE]\n"]), "ended before the answer did"),
    (Response(events(text("a"), text("b")), breaks=True), "broke mid-answer"),
    (Response(events(text("a", "stop"), usage(50))), "counts 50 tokens in an answer of at most max_tokens 4"),
    (Response(events(text("a", ids=[1]), text("b", "stop", ids=[2]), usage(3))), "streamed 2 token ids"),
    (Response(events(text("a", "length"), usage(1))), "cut the answer at 1 of 4 tokens"),
    (Response(events(text("a"), {"error": {"message": "out of memory mid-answer"}})), "out of memory mid-answer"),
    (Response(events(text("a", "stop") | {"error": None}, usage(1))), None),
    (Response(events(text("a", "abort"), usage(1))), "aborted the answer"),
    (Response([b"data: null\n"]), "not a JSON object"),
    (Response([b"data: {oops\n"]), "something other than JSON events"),
    (Response(events(usage(1)), kind="application/json"), "answered application/json, not a stream of events"),
])
def test_an_answer_counts_only_once_it_ended_whole(response, says):
    """A stream that broke off, an answer the engine cut short or whose count is impossible, an engine's error:
    each a failure saying which (they were fast successes: 3 tokens of 100 asked, or 50 times the tokens sent)."""
    def counted():
        answer = event_stream.read(response, "x", "http://h/v1/completions", 0.0, float("inf"))
        return event_stream.counted(answer, "x", 4)

    if says is None:
        assert counted() == 1
    else:
        with pytest.raises(UserError, match=re.escape(says)):
            counted()


def test_a_stream_kept_alive_without_an_answer_ends_at_the_request_limit(monkeypatch):
    pings = Response([b": ping\n"] * 3 + events(text("a", "stop"), usage(1)))
    monkeypatch.setattr(event_stream.time, "perf_counter", iter([10.0, 20.0, 40.0, 80.0]).__next__)
    with pytest.raises(UserError, match="no whole answer within 30 s"):
        event_stream.read(pings, "x", "http://h/v1/completions", 0.0, 30.0)


def test_the_command_line(tiny_folder, our_server, tmp_path, monkeypatch, capsys):
    """`specdecode bench --engine ...`: the usual report with the engine's row; mistakes are one line, exit 2."""
    from specdecode.bench import main as bench_main
    from specdecode.cli import main

    monkeypatch.setattr(bench_main, "sample_tasks", lambda categories, per_category, seed=0, part="held-out": TASKS)

    def run(*args, out=tmp_path):
        monkeypatch.setattr(sys, "argv", ["specdecode", "bench", "--target", str(tiny_folder), "--drafter",
                                          str(tiny_folder), "--dtype", "float32", "--repeats", "1",
                                          "--max-new-tokens", "8", "--threads", "1", "--out", str(out), *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        out, err = capsys.readouterr()
        return exit_info.value.code or 0, (out + err).replace("\n", "")  # rich wraps long lines

    code, out = run("--engine", f"ours=openai:{our_server.url}/v1;model=tiny", "--concurrency", "1,2")
    assert code == 0, out
    text = (tmp_path / "report.md").read_text()
    assert "| ours |" in text and "Engines under load" in text and "3/3" in text
    command = next(line for line in text.splitlines() if line.startswith("- command:"))
    for option in (f"--target {tiny_folder}", "--dtype float32", "--threads 1", f"--out {tmp_path}"):
        assert option in command  # the line reproduces the run
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 2 * len(TASKS) + len(TASKS)
    assert "- date: " in text and "- commit: " in text
    # a second run into the same folder is refused before it touches the first's records
    kept = (tmp_path / "records.jsonl").read_text()
    code, out = run("--engine", "x=openai:http://127.0.0.1:9/v1")
    assert code == 2 and "holds an earlier run's records" in out and (tmp_path / "records.jsonl").read_text() == kept
    for number, (args, says) in enumerate( [(["--engine", "x=http://nowhere"], "expected LABEL=openai:URL"),
                       (["--engine", "x=openai:http://127.0.0.1:9/v1"], "cannot reach"),
                       (["--engine", f"x=openai:{our_server.url}/v1;model=nope"], "HTTP 404"),
                       (["--concurrency", "1,4"], "--concurrency applies to --engine"),
                       (["--engine", f"x=openai:{our_server.url}/v1", "--reference", "y"], "the reference 'y'")]):
        code, out = run(*args, out=tmp_path / f"refused-{number}")
        assert code == 2 and says in out and "Traceback" not in out, (args, out)


# --- llama.cpp's llama-server on loopback (where it is built) ------------------------------------------

@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A tiny chat model as a model folder (for ar and our server) and as GGUF files, with a noisy copy as draft
    (512 positions: room for a real benchmark prompt, byte by byte)."""
    folder = tmp_path_factory.mktemp("engines")
    target = tiny_chat_qwen2(vocab_size=len(TOKENS), seed=5, max_positions=512)
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    write_tiny_gguf(target, folder / "target.gguf")
    write_tiny_gguf(noisy_copy(target, 0.3, 1), folder / "draft.gguf")
    return folder


def llama_server_or_skip() -> Path:
    from specdecode.bench import llamacpp_peers

    try:
        return llamacpp_peers.server_binary()
    except UserError:
        pytest.skip("llama-server is not built (make llama-server)")


@pytest.mark.peers
def test_llama_server_plain_draft_and_ngram_beside_ours(gguf_pair):
    """One run: ar, our server, and llama-server plain, with the draft model and with n-gram drafting, each
    started on loopback; llama-server's rows report its draft counters, and its speculative rows equal its
    plain row (their reference), ours equals ar. (This llama-server drafts with `-md` only when told
    `--spec-type draft-simple`: without it the draft model loads and is never used.)"""
    from specdecode.bench.llamacpp_peers import engine_rows

    llama_server_or_skip()
    models = load_models(str(gguf_pair), str(gguf_pair), dtype="float32", progress=False)
    ours = ServerThread(create_app(Server(models, "tiny", default_method="pld", methods=["pld"])))
    try:
        with engine_rows(gguf_pair / "target.gguf", gguf_pair / "draft.gguf", threads=1, n_ctx=256) as llama:
            engines = build_engines([f"ours=openai:{ours.url}/v1", *llama.values()], {"ar"}, [1, 2, 3])
            runners = build_runners(models, [])
            runners.update({label: engine.runner() for label, engine in engines.items()})
            records = run_benchmark(models, runners, TASKS, CONFIG, repeats=1)
    finally:
        ours.stop()
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    references = {label: engine.spec.reference or "ar" for label, engine in engines.items()}
    summaries = {s.method: s for s in report.summarise(records, {n: True for n in runners}, "ar", references)}
    for r in records:
        if r.method.startswith("llama"):
            assert not r.ids_known and r.new_tokens > 0 and r.prefill_seconds > 0 and r.texts[0]
            assert r.server.source == "llama-server `timings`"
    assert summaries["ours"].exact == (3, 3)
    assert summaries["llama-draft"].exact == (3, 3) and summaries["llama-ngram"].exact == (3, 3)
    assert summaries["llama-draft"].server.drafted > 0 and summaries["llama"].server.drafted == 0
    text = report.markdown(list(summaries.values()), {}, [])
    assert "3/3 (vs llama)" in text


# --- benchmarks/engines.py: the same four engines in one command -----------------------------------------

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "engines.py"


def test_side_by_side_script_says_what_to_build(tmp_path, monkeypatch, capsys):
    """Without llama-server, or without the GGUF files, benchmarks/engines.py stops before starting anything,
    in one line naming the make target (no traceback, exit status 2)."""
    spec = importlib.util.spec_from_file_location("engines_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "ServerProcess", lambda *args: pytest.fail("a server was started"))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # no llama.cpp build and no GGUF in there
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_LLAMA_SERVER", raising=False)
    binary = tmp_path / "llama-server"
    for says in ["run `make llama-server`", f"no GGUF file at {tmp_path / 'gguf'}"]:
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and err.count("\n") == 1 and "Traceback" not in err, err
        binary.touch()  # from here on llama-server is there, the models are not
        monkeypatch.setenv("SPECDECODE_LLAMA_SERVER", str(binary))
    assert "run `make models`" in err


@pytest.mark.peers
def test_side_by_side_script_runs_and_stops_its_servers(gguf_pair, tmp_path):
    """benchmarks/engines.py on the tiny pair, as a user runs it: it starts `specdecode serve` and the three
    llama-servers, the bench's report has the four engine rows beside ar (ours equal to ar, llama-server's
    speculative rows to its plain row), and no server outlives the script."""
    binary = llama_server_or_skip()
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path / "cache"), "SPECDECODE_LLAMA_SERVER": str(binary)}
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--categories", "qa", "--per-category", "1", "--max-new-tokens", "4",
         "--threads", "1", "--dtype", "float32", "--target", str(gguf_pair), "--drafter", str(gguf_pair),
         "--target-gguf", str(gguf_pair / "target.gguf"), "--draft-gguf", str(gguf_pair / "draft.gguf"),
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = (out / "report.md").read_text()
    assert "| ar | 1.00x" in text and "| ours | " in text
    for row, exact in [("ours", "1/1 |"), ("llama-draft", "1/1 (vs llama) |"), ("llama-ngram", "1/1 (vs llama) |")]:
        assert re.search(rf"^\| {row} \|.*{re.escape(exact)}$", text, re.MULTILINE), row
    assert re.search(r"^\| llama \| ", text, re.MULTILINE)
    ports = set(re.findall(r"http://127\.0\.0\.1:(\d+)/v1", text))
    assert len(ports) == 4
    for port in ports:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
