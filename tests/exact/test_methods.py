"""A method resolved once (`methods.choose`): names, tree forms and sources checked, one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode.drafters.options import DEFAULT_CHOICES
from specdecode.errors import UserError
from specdecode.methods import METHODS, MethodChoice, _named, choose, takers, variant_names


@pytest.mark.parametrize("name", variant_names())
def test_every_name_resolves_to_itself(name):
    choice = choose(name)
    assert choice.name == name and choice.method is METHODS[name.split("-tree")[0]]


@pytest.mark.parametrize("name", METHODS)
def test_every_builder_and_verifier_names_a_function(name):
    # the registry names them as "module:function", imported on first use: a typo shows here, not mid-run
    method = METHODS[name]
    assert method.builder is None or callable(_named(method.builder))
    assert callable(method.verifier)


def test_tree_forms_and_budgets():
    assert choose("draft").tree_budget is None
    assert choose("draft-tree").tree_budget == "auto" == choose("draft", tree=True).tree_budget
    assert choose("draft-tree-fixed").tree_budget == "whole"
    assert choose("draft", tree=True, choices=DEFAULT_CHOICES).name == "draft-tree-fixed"
    assert choose("pld", tree=True, budget=3).tree_budget == 3


def test_takers_name_the_methods_that_draft_from_a_source():
    # a method that takes a source joins these lists by its registration alone
    assert {"rest", "composite"} <= set(takers("datastore").split(" and "))
    assert {"pld", "composite"} <= set(takers("reference").split(" and "))
    assert "suffix" not in takers("reference").split(" and ")


@pytest.mark.parametrize("spec, options, message", [
    ("nope", {}, "unknown method"),
    ("ar", {"tree": True}, "no tree form"),
    ("pld", {"tree": True, "choices": DEFAULT_CHOICES}, "no fixed tree shape"),
    ("pld", {"budget": 4}, "add --tree"),
    # not "add --tree", which auto then refused as having no tree form
    ("auto", {"budget": 8}, "'auto' takes no budget [(]it sizes its tree on the cost curve[)]"),
    ("ar", {"budget": 8}, "'ar' takes no budget; a budget sizes the trees of draft"),
    ("draft", {"choices": DEFAULT_CHOICES}, "add --tree"),
    ("pld", {"datastore": "x.npz"}, f"--datastore applies to {takers('datastore')}, not pld"),
    ("suffix", {"reference": "a document"}, f"--reference applies to {takers('reference')}, not suffix"),
    ("rest", {"datastore": "/no/such/datastore.npz"}, "no datastore at"),
    ("pld", {"reference": ""}, "the reference document is empty"),
    ("auto", {"reference": "", "only_if_taken": True}, "the reference document is empty"),
    ("pld", {"reference": b"bytes"}, "the document's text"),
])
def test_what_does_not_go_together_is_one_user_error(spec, options, message):
    with pytest.raises(UserError, match=message) as error:
        choose(spec, **options)
    assert "\n" not in str(error.value)


def test_sources_a_method_does_not_take_are_dropped_when_shared(tmp_path):
    datastore = tmp_path / "store.npz"
    datastore.write_bytes(b"")
    shared = {"datastore": datastore, "reference": "a document", "only_if_taken": True}
    assert choose("suffix", **shared) == choose("suffix")
    rest = choose("rest", **shared)
    assert rest.options.datastore == str(datastore) and rest.reference is None
    pld = choose("pld", **shared)
    assert pld.options.datastore is None and pld.reference == "a document"


def test_a_choice_is_a_frozen_value():
    choice = choose("pld-tree")
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.reference = "x"
    assert choice == choose("pld", tree=True) and isinstance(choice, MethodChoice)
    assert {choice: 1}[choose("pld-tree")] == 1
