"""The grammar engines on the default target's tokenizer (Qwen2.5, 151,936 logits): compile time and the cost of
one token's allowed-token mask, for a JSON schema and a regular expression. Each engine walks the same valid
answer token by token (mask, then advance); the figure is the median mask over the answer's tokens.

    python benchmarks/grammar_masks.py [--repeats 3]

Engines: llguidance, xgrammar, outlines-core (those installed; `pip install -c constraints-cpu.txt NAME`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdecode.bench.server_process import commit
from specdecode.models.registry import DEFAULT_TARGET
from specdecode.paths import cache_dir

VOCAB = 151_936  # the target's logits (the tokenizer's 151,665 tokens, padded)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_ANSWER = json.dumps({
    "name": "Ada Lovelace", "age": 36, "email": "ada.lovelace@example.org", "role": "admin",
    "tags": ["math", "engines"], "address": {"city": "London", "zip": "W1"},
})
REGEX = r"\d{4}-\d{2}-\d{2}: (INFO|WARN|ERROR) [a-zA-Z ]{1,60}\."
REGEX_ANSWER = "2024-03-17: WARN disk almost full on the second volume."


_PREPARED: dict[str, tuple[object, float]] = {}


def prepared(engine: str, build):
    """The engine's view of the tokenizer, built once (with its seconds)."""
    if engine not in _PREPARED:
        started = time.perf_counter()
        _PREPARED[engine] = (build(), time.perf_counter() - started)
    return _PREPARED[engine]


def llguidance_engine(tokenizer: PreTrainedTokenizerBase, kind: str, source: str):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltokenizer, tokenizer_seconds = prepared(
        "llguidance", lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB))
    started = time.perf_counter()
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(source) if kind == "json"
               else llguidance.LLMatcher.grammar_from_regex(source))
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    compile_seconds = time.perf_counter() - started
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)

    def mask() -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def advance(token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    return tokenizer_seconds, compile_seconds, mask, advance


def xgrammar_engine(tokenizer: PreTrainedTokenizerBase, kind: str, source: str):
    import xgrammar

    info, tokenizer_seconds = prepared("xgrammar", lambda: xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(source) if kind == "json" else compiler.compile_regex(source)
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_seconds = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)

    def mask() -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def advance(token: int) -> None:
        assert matcher.accept_token(token)

    return tokenizer_seconds, compile_seconds, mask, advance


def outlines_engine(tokenizer: PreTrainedTokenizerBase, kind: str, source: str):
    import outlines_core

    def vocabulary() -> outlines_core.Vocabulary:
        to_byte = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for text, token in tokenizer.get_vocab().items():
            if token not in special and token != tokenizer.eos_token_id:
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(token)
        return outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    vocabulary, tokenizer_seconds = prepared("outlines-core", vocabulary)
    started = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(source) if kind == "json" else source
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_seconds = time.perf_counter() - started
    bitmask = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

    def mask() -> None:
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def advance(token: int) -> None:
        guide.advance(token)

    return tokenizer_seconds, compile_seconds, mask, advance


FEATURES = {  # one schema per feature, with an instance that satisfies it
    "pattern": ({"type": "string", "pattern": "^a[0-9]+b$"}, '"a12b"'),
    "min/max number": ({"type": "integer", "minimum": 5, "maximum": 99}, "42"),
    "min/max length": ({"type": "string", "minLength": 2, "maxLength": 4}, '"abc"'),
    "min/max items": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2]"),
    "format date-time": ({"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"'),
    "format email": ({"type": "string", "format": "email"}, '"a@b.co"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"x"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"a": {"minimum": 1}}}]}, '{"a": 3}'),
    "const": ({"const": "fixed"}, '"fixed"'),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"}, '{"next": {"next": null}}'),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    '{"k": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"x1": 2}'),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, "0.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "9"),
}


def accepts(engine, tokenizer, schema: dict, instance: str) -> bool:
    """Whether `engine` compiles `schema` and walks `instance` (its canonical tokens) to the end."""
    try:
        _, _, mask, advance = engine(tokenizer, "json", json.dumps(schema))
        for token in tokenizer.encode(instance, add_special_tokens=False):
            mask()
            advance(token)
    except Exception:  # an engine's refusal, whatever its type, is the answer "unsupported"
        return False
    return True


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def measure(engine, tokenizer, kind: str, source: str, answer: str, repeats: int) -> tuple[float, float, list[float]]:
    """(tokenizer seconds, fastest compile seconds, every mask's milliseconds) over `repeats` fresh walks."""
    token_ids = tokenizer.encode(answer, add_special_tokens=False)
    compiles, masks, tokenizer_seconds = [], [], 0.0
    for _ in range(repeats):
        tokenizer_seconds, compile_seconds, mask, advance = engine(tokenizer, kind, source)
        compiles.append(compile_seconds)
        for token in token_ids:
            started = time.perf_counter()
            mask()
            masks.append((time.perf_counter() - started) * 1e3)
            advance(token)
    return tokenizer_seconds, min(compiles), masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir() / "models" / DEFAULT_TARGET)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; commit {commit()}; tokenizer {len(tokenizer)} "
          f"tokens, logits {VOCAB}")
    print(f"{'engine':<14} {'case':<6} {'vocab s':>7} {'compile s':>9} {'median ms':>9} {'mean ms':>7} "
          f"{'max ms':>7} {'answer ms':>9}")
    for name, engine in ENGINES.items():
        for kind, source, answer in (("json", json.dumps(SCHEMA), SCHEMA_ANSWER), ("regex", REGEX, REGEX_ANSWER)):
            try:
                tokenizer_seconds, compile_seconds, masks = measure(engine, tokenizer, kind, source, answer,
                                                                    args.repeats)
            except (ImportError, RuntimeError, ValueError, AssertionError) as error:
                print(f"{name:<14} {kind:<6} failed: {str(error).splitlines()[0][:60]}")
                continue
            mean = statistics.mean(masks)
            per_answer = compile_seconds * 1e3 + mean * len(masks) / args.repeats  # compile + one walk's masks
            print(f"{name:<14} {kind:<6} {tokenizer_seconds:>7.2f} {compile_seconds:>9.3f} "
                  f"{statistics.median(masks):>9.3f} {mean:>7.3f} {max(masks):>7.2f} {per_answer:>9.1f}")
    print("JSON Schema features (compiles and accepts a valid instance):")
    for name, engine in ENGINES.items():
        if importlib.util.find_spec(name.replace("-", "_")) is None:
            print(f"  {name:<14} not installed")
            continue
        supported = [feature for feature, (schema, instance) in FEATURES.items()
                     if accepts(engine, tokenizer, schema, instance)]
        print(f"  {name:<14} {len(supported)}/{len(FEATURES)}; missing: "
              f"{', '.join(sorted(set(FEATURES) - set(supported))) or 'none'}")


if __name__ == "__main__":
    main()
