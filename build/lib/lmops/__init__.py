"""lmops: corpus to a served small Llama-style language model."""

__version__ = "0.1.0"
