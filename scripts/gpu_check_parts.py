"""The parts of scripts/gpu-check that time the static-shape path (`specdecode.models.static`, issue 52) against
the dynamic one and against transformers' own static-cache generate(), and replay recorded acceptance.

  decode    ms per token of plain decoding, 128 new tokens after a fixed prompt, bfloat16, on each target shape,
            in interleaved rounds: the dynamic eager path (`HFCausalLM`), the static path with CUDA graphs
            (`StaticCausalLM(runner="graphs")`; "eager" off CUDA, where graphs do not exist; its capture seconds
            apart) and transformers' generate() with cache_implementation="static", which compiles the forward
            itself on CUDA (its `CompileConfig`, mode reduce-overhead; the compile's seconds apart)
  drafting  seconds per drafted token of each drafter against a one-token forward of the first target on the
            static path: the draft model (static too) drafting 4 tokens a step, EAGLE-3's head (a chain of 4, and
            its tree) and Medusa's heads (chain and tree); every proposal waited for (`devices.clock`)
  replay    the recordings of `specdecode bench --record-acceptance` (benchmarks/acceptance/) replayed on the
            first target's shape with the draft model's, on the static path (`bench.replay_acceptance`): per
            method tokens/s and speedup over plain decoding at the recorded acceptance, next to what the cost
            curve predicts from the replayed steps; every figure labelled "replayed acceptance"

Each takes the run's `Check` (scripts/gpu-check) and returns its part's result; torch and specdecode are
imported inside the functions, as in gpu-check (its --install-wheels runs first).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import time
import traceback
import types
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = REPO / "benchmarks" / "acceptance"
SHIPPED_HEADS = REPO / "specdecode" / "heads" / "qwen2.5-coder-1.5b-instruct"
LABEL = "replayed acceptance"
NEAR_TIE = 2e-2  # a first difference at a top-1/top-2 logit gap below this, relative to top-1: a few bf16 ulps
TREE = 16  # the drafting part's trees: nodes verified per step at most (random heads' own choice would be few)


# --- Helpers the parts share with gpu-check ------------------------------------------------------------------

def timed(device, function) -> tuple[float, object]:
    """(wall seconds of `function()`, the device's queued work waited for before and after: what the engine
    pays for it, launches and kernels together; what it returned)."""
    from specdecode import devices

    devices.synchronize(device)
    start = time.perf_counter()
    value = function()
    devices.synchronize(device)
    return time.perf_counter() - start, value


def random_qwen2(shape, device, dtype=None, seed: int = 0):
    """A Qwen2 of `shape` (gpu-check's `Shape`, or anything with its fields) with transformers' random
    initialisation (normal, std 0.02), built on `device` in `dtype` (default bfloat16): seconds even for 7B on
    a GPU, and nothing read from disk. No EOS, so every
    run generates the tokens it asks for. The LM head is never the input embedding (Qwen2.5-1.5B's is):
    small random layers leave each position's state close to its token's embedding, so a tied head would
    predict the input token again and greedy decoding would repeat one token. A forward costs the same."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype or torch.bfloat16).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def first_difference_margin(target, ids: list[int]) -> dict:
    """The target's two best logits after `ids` (a fresh forward), their gap and the gap relative to the best."""
    import torch

    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([ids], device=next(target.parameters()).device)).logits[0, -1]
    best, second = torch.topk(logits.float(), 2).values.tolist()
    gap = best - second
    return {"top1": best, "top2": second, "margin": gap, "relative": gap / max(abs(best), 1e-6)}


def difference(target, prompt: list[int], reference: list[int], output: list[int]) -> dict | None:
    """Where `output` first parts from `reference` (None: nowhere), and the target's logit gap there."""
    from specdecode.bench.exactness import first_difference

    position = first_difference(reference, output)
    if position is None:
        return None
    margin = first_difference_margin(target, prompt + reference[:position])
    return {"position": position, "plain": reference[position] if position < len(reference) else None,
            "speculative": output[position] if position < len(output) else None,
            **margin, "near_tie": margin["relative"] < NEAR_TIE}


def random_ids(n: int, vocab: int, device, generator):
    import torch

    return torch.randint(vocab, (n,), generator=generator).to(device)


def fixed_prompt(length: int, vocab: int) -> list[int]:
    """Random token ids with spans repeated (so prompt lookup finds copies), `length` long."""
    import torch

    generator = torch.Generator().manual_seed(7)
    base = torch.randint(vocab, (length // 2,), generator=generator).tolist()
    quarter = length // 4
    return (base + base[quarter: 2 * quarter] + base[:quarter])[:length]


def shipped_shape(kind: str) -> dict:
    """The shipped heads' shapes for the default target (their JSON records; defaults where absent)."""
    shape = {"eagle3": {"intermediate": 2048, "vocab": 16384}, "medusa": {"heads": 4, "vocab": 15842}}[kind]
    path = SHIPPED_HEADS / kind / f"{kind}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if kind == "eagle3":
            shape = {"intermediate": data["config"]["intermediate_size"], "vocab": data["config"]["draft_vocab_size"]}
        else:
            shape = {"heads": data["config"]["num_heads"], "vocab": data["record"]["settings"]["vocab"]}
    return shape


def random_eagle3(target_model, seed: int = 0, intermediate: int | None = None, vocab: int = 32000):
    """An EAGLE-3 head for the target (by default the target's MLP width and a 32k draft vocabulary) with random
    weights, on the target's device."""
    import torch

    from specdecode.drafters.eagle3_head import Eagle3Config, Eagle3Head

    config = target_model.config
    size = min(vocab, config.vocab_size)
    torch.manual_seed(seed)
    device = next(target_model.parameters()).device
    with torch.device(device):
        ids = torch.randperm(config.vocab_size)[:size].sort().values
        head = Eagle3Head(Eagle3Config.for_target(config, intermediate or config.intermediate_size, size), ids)
    return head.float().eval()


def random_medusa(target_model, heads: int, vocab: int, seed: int = 0):
    """Medusa heads for the target with random blocks over `vocab` of its tokens, on its device."""
    import torch

    from specdecode.drafters.medusa import MedusaHeads

    config = target_model.config
    torch.manual_seed(seed)
    ids = torch.randperm(config.vocab_size)[: min(vocab, config.vocab_size)].sort().values
    medusa = MedusaHeads(config.hidden_size, heads, ids)
    with torch.no_grad():
        for block in medusa.blocks:
            block.weight.normal_(0, config.hidden_size ** -0.5)
    return medusa.to(device=next(target_model.parameters()).device, dtype=target_model.dtype).eval()


def head_folder(check, shape: str, kind: str) -> Path:
    """A folder holding random heads of `kind` ("eagle3", "medusa") shaped as the shipped ones, for the target
    of `shape`, written once per run (so the methods' own builders load them: `--head`)."""
    folder = check.args.out / "heads" / shape / kind
    if not folder.is_dir():
        model, sizes = check.model(shape).model, shipped_shape(kind)
        seed = zlib.crc32(f"{shape}/{kind}".encode())
        if kind == "eagle3":
            random_eagle3(model, seed, sizes["intermediate"], sizes["vocab"]).save(folder, {"target": shape})
        else:
            random_medusa(model, sizes["heads"], sizes["vocab"], seed).save(folder, {"target": shape})
    return folder


def static_runner(device) -> str:
    """The static path's runner on `device`: CUDA graphs where they exist, else the same code eagerly."""
    return "graphs" if device.type == "cuda" else "eager"


def static_model(check, shape: str):
    """A `StaticCausalLM` over the same weights as `check.model(shape)`, every bucket captured once (its seconds
    in `check.captured`)."""
    key = f"static:{shape}"
    if key not in check._models:
        from specdecode.models.static import StaticCausalLM

        lm = StaticCausalLM(check.model(shape).model, runner=static_runner(check.device),
                            capacity=max(check.plan.contexts) + 1024)
        check._models[key] = lm
        check.captured[shape] = lm.capture()
    return check._models[key]


def decode_seconds(device, engine, prompt: list[int], config) -> tuple[float, int, object]:
    """(seconds from the end of the first step to the end of the run, the tokens made in them, the result): a
    run's decoding without its prompt's prefill, the device waited for at those two points only."""
    from specdecode import devices

    stream = engine.stream(prompt, config)
    start, first = None, 0
    for event in stream:
        if start is None:
            devices.synchronize(device)
            start, first = time.perf_counter(), len(event.token_ids)
    devices.synchronize(device)
    seconds = time.perf_counter() - (start if start is not None else time.perf_counter())
    return seconds, stream.result.new_tokens - first, stream.result


def forward_seconds(check, lm, context: int, widths, repeats: int) -> dict[int, float]:
    """Median seconds of one forward over n new tokens (every row's logits) after `context` random tokens, for
    each n of `widths`, the widths in turn within a repeat (the first repeat warms up)."""
    import torch

    generator = torch.Generator().manual_seed(3)
    lm.reset()
    lm.forward(random_ids(context, lm.vocab_size, check.device, generator), num_logits=1)
    times: dict[int, list[float]] = {n: [] for n in widths}
    for repeat in range(repeats + 1):
        for n in widths:
            tokens = random_ids(n, lm.vocab_size, check.device, generator)
            seconds, _ = timed(check.device, lambda tokens=tokens, n=n: lm.forward(tokens, num_logits=n))
            lm.crop(context)
            if repeat:
                times[n].append(seconds)
    lm.reset()
    return {n: statistics.median(values) for n, values in times.items()}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# --- Part: plain decoding, eager vs graphed vs transformers' static cache compiled --------------------------

def hf_static(model, device, prompt: list[int], new_tokens: int) -> tuple[float, float, int, list[int]]:
    """transformers' generate() with its static cache (which on CUDA compiles the forward: mode reduce-overhead,
    its `CompileConfig`): (seconds from its first new token to its last, the call's whole seconds, the tokens
    after the first, the new ids). Its streamer notes the first new token (the device waited for there)."""
    import torch
    from transformers import CompileConfig
    from transformers.generation.streamers import BaseStreamer

    from specdecode import devices

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.puts, self.at = 0, None

        def put(self, value):  # first the prompt, then each new token
            self.puts += 1
            if self.puts == 2:
                devices.synchronize(device)
                self.at = time.perf_counter()

        def end(self):
            pass

    ids = torch.tensor([prompt], device=device)
    streamer = FirstToken()
    devices.synchronize(device)
    began = time.perf_counter()
    compiled = {"compile_config": CompileConfig(mode="reduce-overhead")} if device.type == "cuda" else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         streamer=streamer, cache_implementation="static", pad_token_id=0, **compiled)
    devices.synchronize(device)
    end = time.perf_counter()
    return end - (streamer.at or began), end - began, new_tokens - 1, out[0, len(prompt):].tolist()


class HFWorker:
    """transformers' static-cache generate() (`hf_static`) in a process of its own, run on request so that its
    runs interleave with the check's own. Apart because its compiled CUDA graphs are not ours: on the first
    H200 run the compiled generate() ended in an illegal memory access, which leaves a process's CUDA context
    unusable, and took the decode part's own paths down with it. Here such a failure is a note and the worker's
    log (hf-worker.log in the report's folder) says what happened."""

    def __init__(self, shape, seed: int, device, prompt: list[int], new_tokens: int, log: Path):
        spec = {"shape": dataclasses.asdict(shape), "seed": seed, "device": str(device), "prompt": prompt,
                "new_tokens": new_tokens}
        self.log = log
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen([sys.executable, __file__, "--hf-worker"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
        self.process.stdin.write(json.dumps(spec) + "\n")
        self.process.stdin.flush()

    def __call__(self, timeout: float) -> dict:
        """One generate(), as `_hf_run` returns it; raises when the worker fails, ends or outlasts `timeout`."""
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], max(1.0, timeout))[0]:
            self.close()
            raise TimeoutError(f"no answer in {timeout:.0f} s")
        line = self.process.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the worker ended: {' / '.join(tail)}")
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def hf_worker() -> None:
    """The worker's side (`python3 scripts/gpu_check_parts.py --hf-worker`): a spec line on stdin, then one
    answer line per request line, the answers on a copy of stdout (anything else printed goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path.insert(0, str(REPO))
    spec = json.loads(sys.stdin.readline())
    import torch

    device = torch.device(spec["device"])
    model = random_qwen2(types.SimpleNamespace(**spec["shape"]), device, seed=spec["seed"])
    for _ in sys.stdin:
        try:
            answer = _hf_run(model, device, spec["prompt"], spec["new_tokens"])
        except Exception as error:
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
        if "error" in answer:
            return


def decode(check) -> dict:
    """Plain decoding of each target shape by the three paths in interleaved rounds (module docstring);
    transformers' in its own process (`HFWorker`)."""
    from specdecode.engine import GenerationConfig, SpeculativeEngine

    plan, rows, notes, cut = check.plan, [], [], None
    config = GenerationConfig(max_new_tokens=plan.new_tokens, ignore_eos=True)
    compiles = check.device.type == "cuda"  # transformers compiles its static forward on CUDA only
    for shape in plan.targets:
        if check.left() < 40:
            cut = f"budget: stopped before {shape}"
            break
        eager, static = check.model(shape), static_model(check, shape)
        prompt = fixed_prompt(plan.prompt, eager.vocab_size)
        runs = {}
        for path, lm in (("eager", eager), ("graphed", static)):
            engine = SpeculativeEngine(lm, None, None, gate=False, step_aside=False)
            runs[path] = lambda engine=engine, prompt=prompt: _ours(check.device, engine, prompt, config)
        first = {path: run() for path, run in runs.items()}  # warm-up (first uses)
        if check.args.inductor and shape == plan.targets[0]:
            _add_inductor(check, shape, prompt, config, runs, first, notes)
        worker = None
        if not compiles or check.left() > (150 if not rows else 120):  # its compile took 30-35 s a shape on an H200
            worker = HFWorker(check.shapes[shape], zlib.crc32(shape.encode()), check.device, prompt,
                              plan.new_tokens, check.args.out / "hf-worker.log")
            runs["hf-static"] = lambda worker=worker: worker(timeout=min(90.0, check.left()))
            try:
                first["hf-static"] = worker(timeout=check.left() - 30)  # transformers compiles here
            except Exception as error:  # its failure is a note; our paths' rows stand
                notes.append(f"{shape}: transformers' static cache failed: {type(error).__name__}: {error}")
                del runs["hf-static"]
        else:
            notes.append(f"{shape}: transformers' compiled static cache skipped for time ({check.left():.0f} s left)")
        samples: dict[str, list[dict]] = {path: [] for path in runs}
        try:
            for round_ in range(plan.rounds):
                if round_ and check.left() < 20:
                    cut = f"budget: {shape} stopped after {round_} round(s)"
                    break
                for path, run in list(runs.items()):
                    try:
                        samples[path].append(run())
                    except Exception as error:
                        if path not in ("hf-static", "inductor"):
                            raise
                        notes.append(f"{shape}: {path} failed in round {round_ + 1}: {type(error).__name__}: {error}")
                        del runs[path]
        finally:
            if worker is not None:
                worker.close()
        reference = samples["eager"][0]["ids"]
        for path, values in samples.items():
            if not values:
                continue
            per_token = [v["seconds"] / v["tokens"] * 1e3 for v in values]
            whole = statistics.median(v["whole"] for v in values)
            rows.append({"shape": shape, "path": path, "ms_per_token": statistics.median(per_token),
                         "range_ms": [min(per_token), max(per_token)], "rounds": len(values),
                         "tokens": values[0]["tokens"], "first_call_seconds": first[path]["whole"],
                         "run_seconds": whole,
                         "capture_seconds": check.captured.get(shape) if path == "graphed" else None,
                         # the first call's seconds beyond a later call's: the compile (transformers) or first use
                         "compile_seconds": (first[path]["whole"] - whole if path == "inductor"
                                             or path == "hf-static" and compiles else None),
                         "compiled": compiles if path == "hf-static" else True if path == "inductor" else None,
                         "same_as_eager": _first_difference(eager.model, prompt, reference, values[0]["ids"])})
        eager_ms = next(r["ms_per_token"] for r in rows if r["shape"] == shape and r["path"] == "eager")
        for row in rows:
            if row["shape"] == shape:
                row["speedup_over_eager"] = eager_ms / row["ms_per_token"]
    return {"rows": rows, "notes": notes, "new_tokens": plan.new_tokens, "prompt_tokens": plan.prompt,
            "cut_short": cut}


def _add_inductor(check, shape: str, prompt: list[int], config, runs: dict, first: dict, notes: list) -> None:
    """--inductor: the static path on inductor's kernels, each shape's captured as a CUDA graph
    (`models.graphs.CompiledGraphs`; on a CPU compiled alone), as the path "inductor" of `runs`; its first use
    compiles (the first target shape only: inductor compiles a deep model's shape for a long while). A failure is a
    note."""
    from specdecode.engine import SpeculativeEngine
    from specdecode.models.static import StaticCausalLM

    runner = "compile-graphs" if check.device.type == "cuda" else "compile"
    try:
        lm = StaticCausalLM(check.model(shape).model, runner=runner, capacity=max(check.plan.contexts) + 1024)
        engine = SpeculativeEngine(lm, None, None, gate=False, step_aside=False)
        first["inductor"] = _ours(check.device, engine, prompt, config)
        runs["inductor"] = lambda: _ours(check.device, engine, prompt, config)
    except Exception as error:
        notes.append(f"{shape}: inductor's kernels failed: {type(error).__name__}: {error}")


def _ours(device, engine, prompt, config) -> dict:
    began = time.perf_counter()
    seconds, tokens, result = decode_seconds(device, engine, prompt, config)
    return {"seconds": seconds, "tokens": tokens, "ids": result.token_ids, "whole": time.perf_counter() - began}


def _hf_run(model, device, prompt, new_tokens) -> dict:
    seconds, whole, tokens, ids = hf_static(model, device, prompt, new_tokens)
    return {"seconds": seconds, "tokens": tokens, "ids": ids, "whole": whole}


def _first_difference(model, prompt: list[int], reference: list[int], output: list[int]) -> str:
    """'yes', or where an output first parts from the eager path's and whether the eager model's two best logits
    there are a near-tie (bfloat16 rounds otherwise there)."""
    parted = difference(model, prompt, reference, output)
    if parted is None:
        return "yes"
    return (f"from token {parted['position']} (top-1/top-2 gap {parted['relative']:.1e} of top-1: "
            f"{'a near-tie' if parted['near_tie'] else 'NOT A TIE'})")


# --- Part: what drafting costs per drafted token ------------------------------------------------------------

def timed_drafter(inner, clock):
    """`inner`, its every proposal timed by `clock` (`devices.clock`: the device waited for at each reading)
    and sized, in `.seconds` and `.sizes`; `.host_seconds`: from the start to the proposal's return, before its
    device work is waited for (the host's part, where the device runs behind it)."""
    from specdecode.bench.acceptance import Wrapped

    class Timed(Wrapped):
        def __init__(self):
            super().__init__(inner)
            self.seconds: list[float] = []
            self.host_seconds: list[float] = []
            self.sizes: list[int] = []

        def propose(self, context, max_tokens, params, generator):
            start = clock()
            draft = self.inner.propose(context, max_tokens, params, generator)
            returned = time.perf_counter()
            self.seconds.append(clock() - start)
            self.host_seconds.append(returned - start)
            self.sizes.append(len(draft))
            return draft

    return Timed()


def method_drafter(check, method: str, target, draft, budget: int | None = None):
    """The drafter of `method` as the method registry builds it for `target` (and the draft model `draft`),
    the trained heads' methods over random heads shaped as the shipped ones (`head_folder`); `budget`: a tree's
    nodes fixed (default: the method's own choice)."""
    from specdecode.api import Models
    from specdecode.methods import choose

    kind = next((k for k in ("eagle3", "medusa") if method.startswith(k)), None)
    if method == "auto":  # its head on the default target: the shipped Medusa heads (`drafters.auto.heads_for`)
        kind = "medusa"
    head = None if kind is None else str(head_folder(check, check.plan.targets[0], kind))
    return Models(target, None, draft).drafter_for(choose(method, head=head, budget=budget, only_if_taken=True))


def forced_drafters(check, target, draft) -> dict:
    """The drafters the drafting part times: fixed sizes where a drafter has them (every step drafts), the
    trees as their methods grow them."""
    from specdecode.drafters import eagle3
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.drafters.eagle3_head import Eagle3Head
    from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads

    shape = check.plan.targets[0]
    head, _ = Eagle3Head.load(head_folder(check, shape, "eagle3"), device=check.device)
    heads, _ = MedusaHeads.load(head_folder(check, shape, "medusa"), dtype=target.model.dtype, device=check.device)
    # the static head cache where the target is on the static path (when this checkout has one)
    state = {"state": eagle3.eagle3_state(head, target)} if hasattr(eagle3, "eagle3_state") else {}
    return {
        "draft model, 4 a step": lambda: DraftModelDrafter(draft, num_tokens=4, adaptive=False,
                                                           confidence_threshold=0.0),
        "eagle3, 4 a step": lambda: eagle3.Eagle3Drafter(head, target.model, max_tokens=4, min_confidence=0.0,
                                                         **state),
        f"eagle3-tree, at most {TREE} nodes": lambda: method_drafter(check, "eagle3-tree", target, draft, TREE),
        f"medusa, {heads.num_heads} heads": lambda: MedusaDrafter(heads, target.model),
        f"medusa-tree, at most {TREE} nodes": lambda: method_drafter(check, "medusa-tree", target, draft, TREE),
    }


def drafting(check) -> dict:
    """Seconds per drafted token of each drafter (`forced_drafters`) over a greedy run on the first target's
    static path, against that path's one-token forward after the prompt; and the draft model's own one-token
    forward against the target's."""
    from specdecode import devices
    from specdecode.engine import GenerationConfig, SpeculativeEngine

    plan, rows = check.plan, []
    target, draft = static_model(check, plan.targets[0]), static_model(check, plan.draft)
    prompt = fixed_prompt(plan.prompt, target.vocab_size)
    one = forward_seconds(check, target, plan.prompt, (1,), plan.repeats)[1]
    draft_one = forward_seconds(check, draft, plan.prompt, (1,), plan.repeats)[1]
    config = GenerationConfig(max_new_tokens=plan.new_tokens, ignore_eos=True)
    for name, make in forced_drafters(check, target, draft).items():
        if check.left() < 15:
            rows.append({"drafter": name, "error": "budget: skipped"})
            continue
        try:
            drafter = timed_drafter(make(), devices.clock(check.device))
            engine = SpeculativeEngine(target, None, drafter, gate=False, step_aside=False)
            engine.generate(prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True))  # warm-up, captures
            drafter.seconds, drafter.host_seconds, drafter.sizes = [], [], []
            result = engine.generate(prompt, config)
        except Exception as error:  # one drafter's failure is reported; the others still run
            rows.append({"drafter": name, "error": f"{type(error).__name__}: {error}"})
            continue
        drafted = sum(drafter.sizes)
        per_token = sum(drafter.seconds) / drafted if drafted else None
        rows.append({"drafter": name, "steps": len(result.steps), "drafted_per_step": drafted / len(drafter.sizes),
                     "seconds_per_step": statistics.median(drafter.seconds),
                     "host_seconds_per_step": statistics.median(drafter.host_seconds),
                     "seconds_per_drafted_token": per_token,
                     "of_a_forward": None if per_token is None else per_token / one})
    return {"rows": rows, "shape": plan.targets[0], "draft_shape": plan.draft, "forward_seconds": one,
            "draft_forward_seconds": draft_one, "draft_forward_relative": draft_one / one,
            "runner": static_runner(check.device)}


# --- The report's lines for these parts ---------------------------------------------------------------------

def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def decode_summary(result: dict) -> list[str]:
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        cells = [f"{r['path']} {_ms(r['ms_per_token'])}" for r in result["rows"] if r["shape"] == shape]
        lines.append(f"- plain decoding {shape}, ms/token: " + ", ".join(cells))
    return lines + [f"- decode: {note}" for note in result["notes"]]


def decode_markdown(result: dict, table) -> list[str]:
    lines = [f"Plain decoding, greedy, {result['new_tokens']} new tokens after a {result['prompt_tokens']}-token "
             "prompt; ms per token after the first (the prefill left out), the median over interleaved rounds and "
             "its range. eager: transformers' forward over a growing cache (`HFCausalLM`); graphed: the static "
             "path (`StaticCausalLM`, CUDA graphs on CUDA, its runner eager elsewhere; capture seconds apart); "
             "hf-static: transformers' generate() with cache_implementation=\"static\" (compiled by transformers "
             "on CUDA, CompileConfig mode reduce-overhead; the first call's extra seconds: the compile).", ""]
    lines += table(["shape", "path", "ms/token", "range", "x eager", "rounds", "capture s", "compile s",
                    "same as eager"],
                   [[r["shape"], r["path"], r["ms_per_token"], f"{r['range_ms'][0]:.3g}-{r['range_ms'][1]:.3g}",
                     r["speedup_over_eager"], r["rounds"], r["capture_seconds"], r["compile_seconds"],
                     r["same_as_eager"]] for r in result["rows"]])
    notes = result["notes"] + ([f"Cut short: {result['cut_short']}"] if result.get("cut_short") else [])
    return lines + ([""] + notes if notes else [])


def drafting_summary(result: dict) -> list[str]:
    cells = [f"{r['drafter']} " + (r["error"] if "error" in r else "n/a" if r["of_a_forward"] is None
                                  else f"{r['of_a_forward']:.3f}") for r in result["rows"]]
    return [f"- drafting per drafted token, of a {result['shape']} forward ({_ms(result['forward_seconds'] * 1e3)}): "
            + ", ".join(cells) + f"; the draft model's forward {result['draft_forward_relative']:.3f} of it"]


def drafting_markdown(result: dict, table) -> list[str]:
    lines = [f"Each drafter's proposals over a greedy run on {result['shape']} (static path, runner "
             f"{result['runner']}, gate off), each waited for: seconds per drafted token against one one-token "
             f"target forward after the prompt ({result['forward_seconds'] * 1e3:.3f} ms). The draft model "
             f"({result['draft_shape']}, static path) alone: a one-token forward "
             f"{result['draft_forward_seconds'] * 1e3:.3f} ms, {result['draft_forward_relative']:.3f} of the "
             "target's.", ""]
    lines[0] += (" host ms/step: the proposal's return, before its device work is waited for (the clock "
                 "synchronizes at the start and the end).")
    return lines + table(["drafter", "steps", "drafted/step", "ms/step", "host ms/step", "ms/drafted token",
                          "of a forward", "error"],
                         [[r["drafter"], r.get("steps"), r.get("drafted_per_step"),
                           None if "seconds_per_step" not in r else r["seconds_per_step"] * 1e3,
                           None if "host_seconds_per_step" not in r else r["host_seconds_per_step"] * 1e3,
                           None if r.get("seconds_per_drafted_token") is None else r["seconds_per_drafted_token"] * 1e3,
                           r.get("of_a_forward"), r.get("error")] for r in result["rows"]])


if __name__ == "__main__" and sys.argv[1:] == ["--hf-worker"]:
    hf_worker()
