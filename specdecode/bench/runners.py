"""What the benchmark runs: our methods through the engine, and the peers a user would otherwise pick:
transformers' own generate() (plain, with assistant_model=, with prompt_lookup_num_tokens=) and
llama.cpp's plain decoding of the target's GGUF on the torch backend, llama.cpp's own speculative modes on
the llamacpp backend (`bench.llamacpp_peers`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.api import Models, load_models
from specdecode.bench import llamacpp_peers
from specdecode.bench.base import Output, Runner
from specdecode.engine import GenerationConfig, SpeculativeEngine, StepEvent
from specdecode.errors import UserError
from specdecode.methods import choose, resolve
from specdecode.models.hf import torch_target

if TYPE_CHECKING:
    from specdecode.bench.acceptance import Recorder


def our_runner(models: Models, method: str, datastore: str | None = None, head: str | None = None,
               recorder: Recorder | None = None, step_aside: bool | None = None) -> Runner:
    """One of our methods; `recorder`: each step's draft shape and acceptance recorded (`bench.acceptance`);
    `step_aside=False`: every step speculates (no step-aside switch: `engine.payoff`), None: the method's way."""
    engine = models.engine(method, datastore=datastore, head=head)
    if step_aside is not None:  # the same engine, the switch set
        engine = SpeculativeEngine(engine.target, engine.tokenizer, engine.drafter, method=engine.method,
                                   tree_budget=engine.tree_budget, verifier=engine.verifier, step_aside=step_aside)
    if recorder is not None:
        recorder.attach(engine)
    return engine_runner(engine, resolve(method)[0].lossless)


def engine_runner(engine: SpeculativeEngine, lossless: bool = True) -> Runner:
    """Any engine, for instance one whose drafter has settings no method name gives (tuning scripts)."""

    def run(prompt_ids: list[int], config: GenerationConfig) -> Output:
        # until the first token: a long prompt's chunks fed before the first step, then that step
        start, chunks = time.perf_counter(), 0.0
        stream = engine.stream(prompt_ids, config)
        for item in stream.items():
            if not isinstance(item, StepEvent):
                chunks = time.perf_counter() - start
        result = stream.result
        assert result is not None  # the stream ran to its end
        first = result.steps[0] if result.steps else None
        prefill = chunks + first.draft_seconds + first.verify_seconds if first else None
        return Output(result.token_ids, result.seconds, result.steps, prefill)

    return Runner(engine.method, lossless, False, run, engine.forget, engine.target.max_context)


def peer_runner(models: Models, name: str, **generate_kwargs) -> Runner:
    """transformers' generate() on the same target model, counted from ids like ours."""
    model, tokenizer = torch_target(models.target, name).model, models.tokenizer

    def run(prompt_ids: list[int], config: GenerationConfig) -> Output:
        params = config.sampling
        sampling = {} if params.greedy else {
            "temperature": params.temperature, "top_k": params.top_k or None, "top_p": params.top_p,
        }
        if config.seed is not None:
            torch.manual_seed(config.seed)  # generate() draws from the global generator
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids], device=model.device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
                max_new_tokens=config.max_new_tokens,
                do_sample=not params.greedy,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                **sampling,
                **generate_kwargs,
            )
        seconds = time.perf_counter() - start
        return Output(out[0, len(prompt_ids) :].tolist(), seconds, None)

    return Runner(name, True, True, run)


def llamacpp_plain_runner(models: Models) -> Runner:
    """Plain decoding of the target's own GGUF file through llama.cpp, as a peer of torch runs: the
    fastest plain decoder on a CPU, so one table shows every torch path against it. Its weights are the
    GGUF's (Q4_K_M for the default target), not the torch model's, so its output is not compared."""
    from specdecode.models.llamacpp import LlamaCppLM

    if models.target_gguf is None:
        raise UserError("llamacpp-ar decodes the target's GGUF file: load the target by registered name or as a "
                        ".gguf file")
    # the default context holds the long-context category's longest prompts (16k tokens) and their answers
    engine = SpeculativeEngine(LlamaCppLM(models.target_gguf), models.tokenizer,
                               method="llamacpp-ar")
    return dataclasses.replace(engine_runner(engine, lossless=False), peer=True)


@dataclass(frozen=True)
class Peer:
    backend: str  # the backend whose plain decoding it is compared with
    needs_draft_model: bool
    build: Callable[[Models], Runner]


def _llamacpp_server(name: str) -> Callable[[Models], Runner]:
    return lambda models: llamacpp_peers.server_runner(models, name)


def _llamacpp_prompt_lookup(models: Models) -> Runner:
    return llamacpp_peers.prompt_lookup_runner(models)


PEERS = {
    "hf-plain": Peer("torch", False, lambda models: peer_runner(models, "hf-plain")),
    "hf-assisted": Peer("torch", True, lambda models: peer_runner(
        models, "hf-assisted", assistant_model=torch_target(models.require_draft(), "hf-assisted").model)),
    "hf-prompt-lookup": Peer("torch", False, lambda models: peer_runner(
        models, "hf-prompt-lookup", prompt_lookup_num_tokens=10)),
    **{name: Peer("llamacpp", name == "llama-server-draft", _llamacpp_server(name))
       for name in llamacpp_peers.SERVER_MODES},
    "llama-cpp-python-pld": Peer("llamacpp", False, _llamacpp_prompt_lookup),
    "llamacpp-ar": Peer("torch", False, llamacpp_plain_runner),
}


def needs_draft_model(names: list[str], target, backend: str = "torch", head: str | None = None) -> bool:
    """Whether a row loads the draft model (ours: `MethodChoice.loads_draft_model` on this target)."""
    return any(PEERS[name].needs_draft_model if name in PEERS
               else choose(name, head=head, only_if_taken=True).loads_draft_model(target, backend) for name in names)


def runner_names(names: list[str]) -> list[str]:
    """The rows `build_runners` makes, in its order."""
    return list(dict.fromkeys(["ar", *names]))


def build_runners(models: Models, names: list[str], datastore: str | None = None,
                  head: str | None = None, recorder: Recorder | None = None,
                  step_aside: bool | None = None) -> dict[str, Runner]:
    """Runners by name (ours and peers); `ar` always comes first: it is the reference. `datastore` and `head`
    go to the methods that take them (`api.Models.engine`), `recorder` records our drafting methods' steps,
    `step_aside` sets their step-aside switch (`our_runner`)."""
    return {name: our_runner(models, name) if name == "ar" else PEERS[name].build(models) if name in PEERS
            else our_runner(models, name, datastore, head, recorder, step_aside) for name in runner_names(names)}


@dataclass(frozen=True)
class Setup:
    """What a benchmark loads and runs (the command's options), on this machine or on each Ray node."""

    methods: list[str]
    target: str
    drafter: str
    dtype: str = "auto"
    draft_dtype: str = "auto"
    backend: str = "torch"
    threads: int = 2
    datastore: str | None = None
    device: str | None = None  # the torch backend's (`devices.resolve`); None: "auto"
    head: str | None = None  # a trained head's folder for the methods of its kind (the same path on every Ray node)
    step_aside: bool | None = None  # False: our methods speculate at every step (`our_runner`)

    def load(self, progress: bool = True, recorder: Recorder | None = None) -> tuple[Models, dict[str, Runner]]:
        """The models (the draft model only when a method needs it) and the runners, on `threads` threads;
        `recorder`: our methods' steps recorded (`bench.acceptance`)."""
        torch.set_num_threads(self.threads)
        drafter = self.drafter if needs_draft_model(self.methods, self.target, self.backend, self.head) else None
        models = load_models(self.target, drafter, dtype=self.dtype, draft_dtype=self.draft_dtype,
                             backend=self.backend, progress=progress, device=self.device)
        return models, build_runners(models, self.methods, datastore=self.datastore, head=self.head,
                                     recorder=recorder, step_aside=self.step_aside)
