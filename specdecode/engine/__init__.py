from specdecode.engine.loop import SpeculativeEngine
from specdecode.engine.sequence import GenerationConfig, GenerationResult, StepEvent, Stream

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "StepEvent", "Stream"]
