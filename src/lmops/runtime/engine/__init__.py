"""The lmops inference engine: paged KV cache, continuous batching, prefix caching, sampling.

engine = LLMEngine.from_pretrained(model_dir)
outs = engine.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=64))
loop = EngineLoop(engine).start(); stream = loop.submit(prompt, params)

The names load on first use, so `lmops.runtime.engine.config` (what gunicorn's master reads
its settings from) is importable without torch.
"""

import importlib

_MODULES = {
    "CompletionOutput": "sequence",
    "EngineConfig": "config",
    "EngineLoop": "loop",
    "EngineMetrics": "metrics",
    "LLMEngine": "engine",
    "PromptTooLongError": "engine",
    "QueueFullError": "loop",
    "RequestMetrics": "metrics",
    "RequestOutput": "sequence",
    "RequestStream": "loop",
    "SamplingParams": "sampling",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'lmops.runtime.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lmops.runtime.engine.{_MODULES[name]}"), name)
