"""specdecode: speculative decoding for large language models.

Drafters (specdecode.drafters) propose tokens, verifiers (specdecode.verify) keep what the target model
agrees with, and the engine (specdecode.engine) runs the draft-then-verify loop on a backend
(specdecode.models). See specdecode.types for the vocabulary and specdecode.metrics for the metrics.
"""

from specdecode.api import Models, generate, load_models
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.types import SamplingParams

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "Models",
    "SamplingParams",
    "SpeculativeEngine",
    "UserError",
    "generate",
    "load_models",
]
