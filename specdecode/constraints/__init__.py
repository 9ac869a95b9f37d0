"""Structured output: constraints (JSON schemas, regular expressions, Lark grammars) and the per-sequence
matcher that masks every position speculation verifies (see `matcher` for what lossless means here)."""

from specdecode.constraints.grammar import Constraint
from specdecode.constraints.matcher import Matcher, masked_logits

__all__ = ["Constraint", "Matcher", "masked_logits"]
