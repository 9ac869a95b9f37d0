"""specdecode: speculative decoding for large language models.

Drafters (specdecode.drafters) propose tokens, verifiers (specdecode.verify) keep what the target model
agrees with, and the engine (specdecode.engine) runs the draft-then-verify loop on a backend
(specdecode.models). See specdecode.types for the vocabulary and specdecode.metrics for the metrics.

The public names below are imported on first use (PEP 562), so that importing a light submodule (the
command line, the method registry) does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.api import Models, generate, load_models
    from specdecode.constraints import Constraint
    from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
    from specdecode.errors import UserError
    from specdecode.types import SamplingParams

# each public name, by the module it comes from
_PUBLIC = {
    "Constraint": "specdecode.constraints",
    "GenerationConfig": "specdecode.engine",
    "GenerationResult": "specdecode.engine",
    "Models": "specdecode.api",
    "SamplingParams": "specdecode.types",
    "SpeculativeEngine": "specdecode.engine",
    "UserError": "specdecode.errors",
    "generate": "specdecode.api",
    "load_models": "specdecode.api",
}

__all__ = [
    "Constraint",
    "GenerationConfig",
    "GenerationResult",
    "Models",
    "SamplingParams",
    "SpeculativeEngine",
    "UserError",
    "generate",
    "load_models",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
