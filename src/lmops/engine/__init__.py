"""The lmops inference engine: paged KV cache, continuous batching, prefix caching, sampling.

engine = LLMEngine.from_pretrained(model_dir)
outs = engine.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=64))
loop = EngineLoop(engine).start(); stream = loop.submit(prompt, params)
"""

from lmops.engine.engine import LLMEngine, PromptTooLongError
from lmops.engine.loop import EngineLoop, QueueFullError, RequestStream
from lmops.engine.metrics import EngineMetrics, RequestMetrics
from lmops.engine.sampling import SamplingParams
from lmops.engine.sequence import CompletionOutput, RequestOutput

__all__ = [
    "CompletionOutput",
    "EngineLoop",
    "EngineMetrics",
    "LLMEngine",
    "PromptTooLongError",
    "QueueFullError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
]
