from specdecode.engine.loop import GenerationConfig, GenerationResult, SpeculativeEngine, StepEvent, Stream

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "StepEvent", "Stream"]
