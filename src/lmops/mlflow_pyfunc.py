"""MLflow models-from-code definition: the pyfunc around a safetensors model directory.

MLflow stores this file's source (not a pickle) with the model; loading runs it,
and `predict(["def ", ...])` returns one completion per prompt. Sampling knobs
can be passed as `params` (max_new_tokens, temperature, top_k, top_p, seed).
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel

from lmops.generate import Sampling, complete
from lmops.model import Llama
from lmops.tokenizer import load_tokenizer


class LmopsCompletionModel(PythonModel):
    def load_context(self, context) -> None:
        model_dir = context.artifacts["model_dir"]
        self.model = Llama.from_pretrained(model_dir)
        self.tokenizer = load_tokenizer(model_dir)

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        sampling = Sampling(**(params or {}))
        return [complete(self.model, self.tokenizer, prompt, sampling) for prompt in model_input]


mlflow.models.set_model(LmopsCompletionModel())
