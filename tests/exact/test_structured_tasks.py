"""The benchmark's structured category (`bench.structured`): every task's constraint compiles, the independent
check (`valid`) accepts what the constraint describes and refuses what it does not, and the harness applies a
task's constraint to our methods and refuses it to a peer."""

from __future__ import annotations

import json

import pytest

from specdecode.bench import structured
from specdecode.bench.base import Output, Runner
from specdecode.bench.datasets import CATEGORIES, DEFAULT_CATEGORIES
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import run_task
from specdecode.constraints import Constraint


def test_the_category_has_three_kinds_of_four_and_runs_only_when_named():
    tasks = sample_tasks(["structured"], None, part="all")
    assert len(tasks) == 12 and len({t.task_id for t in tasks}) == 12
    assert {t.task_id.split("/")[0] for t in tasks} == {"extract", "tool", "form"}
    assert all(t.constraint is not None for t in tasks)
    assert "structured" in CATEGORIES and "structured" not in DEFAULT_CATEGORIES


@pytest.mark.parametrize("constraint, good, bad", [
    (Constraint.json_schema(structured.WEATHER), '{"city": "Lisbon", "unit": "fahrenheit", "days": 3}',
     '{"city": "Lisbon", "unit": "kelvin", "days": 3}'),
    (Constraint.json_schema(structured.INVOICE),
     json.dumps({"invoice_number": "INV-2041", "date": "2024-03-08", "customer": "Northwind", "currency": "EUR",
                 "items": [{"description": "cable", "quantity": 3, "unit_price": 9.5}]}),
     json.dumps({"invoice_number": "INV-2041", "date": "8 March", "customer": "Northwind", "currency": "EUR",
                 "items": []})),
    (Constraint.regex(structured.FORMS[0][1]), "1969-07-20", "20 July 1969"),
    (Constraint.json_object(), '{"a": 1}', "[1]"),
])
def test_valid_checks_answers_without_the_grammar_engine(constraint, good, bad):
    assert structured.valid(constraint, good) and not structured.valid(constraint, bad)
    assert not structured.valid(constraint, good[:-1])  # cut short: not a whole answer


class FakeModels:
    """What `run_task` asks of the models: a chat encoding and a decoder."""

    class tokenizer:
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    class target:
        max_context = 1000

    @staticmethod
    def encode_chat(messages):
        return [ord(c) for c in messages[-1]["content"][:10]]


def test_the_harness_gives_ours_the_constraint_and_refuses_it_to_a_peer():
    task = sample_tasks(["structured"], None, part="all")[0]
    seen = []

    def run(prompt_ids, config):
        seen.append(config.constraint)
        return Output(token_ids=[ord("{")], seconds=0.1, steps=[])

    ours = run_task(FakeModels, Runner("pld", True, False, run), task, task_config := _config(), 0)
    assert ours.ok and seen == [task.constraint]
    peer = run_task(FakeModels, Runner("hf-assisted", True, True, run), task, task_config, 0)
    assert not peer.ok and "constraint" in peer.error and len(seen) == 1


def _config():
    from specdecode.engine import GenerationConfig

    return GenerationConfig(max_new_tokens=8)
