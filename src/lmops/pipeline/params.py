"""params.yaml -> typed, validated config objects.

Every knob of the pipeline lives in params.yaml; this module is the only place
that reads it. Unknown keys and wrong types stop with a message naming the key
and the expected type, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lmops import atomic
from lmops.errors import LmopsError
from lmops.runtime.model_config import LlamaShape

PARAMS_FILE = "params.yaml"
log = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]


class DataConfig(_Section):
    # python-stdlib, a file, a directory, a glob, or a file:// https:// s3:// az:// gs:// URL
    source: str = "python-stdlib"
    format: Literal["auto", "text", "jsonl", "csv", "parquet"] = "auto"  # auto = from the extension
    text_field: Annotated[str, Field(min_length=1)] = "text"  # the column/key of jsonl, csv, parquet
    encoding_errors: Literal["strict", "replace"] = "strict"
    document_unit: Literal["auto", "file", "row", "paragraph", "line", "chunk"] = "auto"
    chunk_bytes: PositiveInt = 4096
    max_bytes: PositiveInt | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None


class SplitConfig(_Section):
    # random: seeded, by document; tail: the last bytes of the corpus, in source order
    # (val, then test), what time-ordered data needs and nanoGPT's split.
    method: Literal["random", "tail"] = "random"
    val_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.05
    test_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.05
    seed: int = 1337

    @model_validator(mode="after")
    def _leave_room_for_train(self) -> SplitConfig:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("val_fraction + test_fraction must be < 1 (nothing left to train on)")
        return self


AUTO = "auto"


class TokenizerConfig(_Section):
    # 256 byte symbols + special tokens is the floor of a byte-level BPE. auto: from the train
    # split's size (lmops.pipeline.tokenize_stage.auto_vocab_size).
    vocab_size: Annotated[int, Field(ge=260, le=65535)] | Literal["auto"] = AUTO
    min_frequency: PositiveInt = 2
    # The BPE learns from at most this many bytes of the train split (all of it when smaller),
    # pieces of whole lines at places drawn with `seed`: time and memory stay bounded.
    train_bytes: Annotated[int, Field(ge=1 << 16)] = 64_000_000
    seed: int = 1337
    # Token files are shards of at most this many bytes (read through memmap across shards).
    shard_bytes: Annotated[int, Field(ge=4)] = 1_000_000_000


class ModelConfig(LlamaShape, _Section):
    """params.yaml's face of the model's shape (`lmops.runtime.model_config.LlamaShape`, where its
    fields, defaults and checks are defined once): read as strictly as every section (no type
    coercion) and taking the deprecated `block_size`. The tokenizer adds the vocabulary at train
    time, and train replaces `dropout: auto` (the one value the shape itself does not take) with
    what the data calls for (`lmops.pipeline.train.follow_the_data`)."""

    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] | Literal["auto"] = AUTO

    @model_validator(mode="before")
    @classmethod
    def _rename_block_size(cls, raw: Any) -> Any:
        """`model.block_size` was the context length; `block_size` now means KV-cache pages only."""
        if isinstance(raw, dict) and "block_size" in raw:
            if "max_seq_len" in raw:
                raise ValueError("give model.max_seq_len only (model.block_size is its deprecated name)")
            log.warning("params: model.block_size is deprecated; rename it to model.max_seq_len")
            raw = {("max_seq_len" if k == "block_size" else k): v for k, v in raw.items()}
        return raw


def cooldown_steps(max_steps: int, fraction: float) -> int:
    """The length of wsd's cooldown: the last `fraction` of `max_steps`, rounded."""
    return round(fraction * max_steps)


class TrainConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 1337
    max_steps: PositiveInt = 754
    batch_size: PositiveInt = 16
    grad_accum_steps: PositiveInt = 1
    learning_rate: Annotated[float, Field(gt=0)] = 3e-3
    min_lr: Annotated[float, Field(ge=0)] = 3e-4
    warmup_steps: Annotated[int, Field(ge=0)] = 40
    # After warmup: cosine decay to min_lr at max_steps, or (plateau) learning_rate times
    # lr_plateau_factor after every lr_plateau_patience evaluations without a lower validation
    # loss, down to min_lr, or (wsd) learning_rate until the last cooldown_fraction x max_steps
    # steps, which fall linearly to min_lr. Under plateau and before wsd's cooldown nothing
    # depends on max_steps, so a longer run passes through every state of a shorter one, and
    # a checkpoint from there resumes under a raised max_steps (README, "Training longer").
    # auto: chosen by train from the epochs the run makes over its data (follow_the_data).
    lr_schedule: Literal["auto", "cosine", "plateau", "wsd"] = AUTO
    lr_plateau_patience: PositiveInt = 1
    lr_plateau_factor: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5
    cooldown_fraction: Annotated[float, Field(gt=0.0, le=1.0, validate_default=True)] = 0.2
    # adamw: AdamW for every weight; muon: Muon for the decoder layers' matrices (attention and
    # MLP projections), AdamW for the embeddings, the head and the norms.
    optimizer: Literal["adamw", "muon"] = "muon"
    # Muon's peak rate, scaled per matrix to AdamW's update size (torch's match_rms_adamw), so
    # it sits on learning_rate's scale; it follows the same schedule (x muon_lr / learning_rate).
    muon_lr: Annotated[float, Field(gt=0)] = 3e-3
    muon_momentum: Fraction = 0.95  # Nesterov momentum of Muon's updates
    # Decoupled (lr x weight_decay per step), on matrices; auto: from the epochs, as lr_schedule.
    weight_decay: Annotated[float, Field(ge=0)] | Literal["auto"] = AUTO
    beta1: Fraction = 0.9
    beta2: Fraction = 0.95
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    eval_interval: PositiveInt = 50
    eval_batches: PositiveInt = 8
    # Export (and register) the weights with the lowest validation loss seen, not the last ones.
    keep_best: bool = True
    # Stop after this many evaluations without a lower validation loss; null = never stop early.
    early_stopping_patience: PositiveInt | None = None
    checkpoint_interval: PositiveInt = 100
    log_interval: PositiveInt = 10
    threads: Annotated[int, Field(ge=0)] = 0  # 0 = torch default
    # torch.compile the training step (inductor: needs a C++ compiler on CPU, else eager).
    compile: bool = True
    # auto = bfloat16 autocast where matrix products run natively in it, else float32.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"

    @field_validator("cooldown_fraction")
    @classmethod
    def _cooldown_fits(cls, fraction: float, info: ValidationInfo) -> float:
        """wsd's warmup and cooldown must fit in the run (fields failing their own checks are absent)."""
        max_steps, warmup = info.data.get("max_steps"), info.data.get("warmup_steps")
        if info.data.get("lr_schedule") == "wsd" and max_steps and warmup is not None:
            cooldown = cooldown_steps(max_steps, fraction)
            if warmup + cooldown > max_steps:
                raise ValueError(
                    f"the wsd cooldown ({fraction} x max_steps = {cooldown} steps) and warmup_steps "
                    f"({warmup}) are longer than max_steps ({max_steps}): lower one of them"
                )
        return fraction

    @model_validator(mode="after")
    def _lr_order(self) -> TrainConfig:
        if self.min_lr > self.learning_rate:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})")
        return self


class EvaluateConfig(_Section):
    # The test split is scored in units: blocks of whole lines of about unit_bytes, each on
    # its own, so two models (whatever their tokenizers) are compared on identical text. All
    # of them when there are at most max_units, else a seeded sample spread over the split.
    unit_bytes: Annotated[int, Field(ge=64)] = 4096
    max_units: PositiveInt | None = 2048
    batch_size: PositiveInt = 16  # windows of max_seq_len tokens per forward
    prompts: list[str] = ["def ", "class ", "import "]
    max_new_tokens: PositiveInt = 64  # sampling itself: the model's generation_config.json
    seed: int = 1337  # of the unit sample and the samples: the stage's output is reproducible


# The behavioural checks a candidate must pass (lmops.pipeline.checks), and user ones as
# "module:function".
BUILTIN_CHECKS = (
    "greedy_deterministic",
    "nonempty_finite",
    "stop_sequences",
    "eos_reachable",
    "repetition",
    "code_compiles",
)


SLICE_BY_PATTERN = r"^(path|directory|extension|field:\S+)$"


class PromoteConfig(_Section):
    model_name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] = "lmops"
    alias: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")] = "champion"
    export_dir: str = "production_service/model"
    # The gate: promote only when the paired bootstrap interval (at `confidence`) of the
    # candidate's bits/byte minus the champion's, on the same test units, lies below
    # -min_improvement.
    min_improvement: Annotated[float, Field(ge=0.0)] = 0.02
    confidence: Annotated[float, Field(gt=0.5, lt=1.0)] = 0.95
    bootstrap_samples: Annotated[int, Field(ge=100)] = 2000
    seed: int = 1337  # of the bootstrap
    checks: list[Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")]] = list(BUILTIN_CHECKS)
    # Candidate vs champion on one fixed workload; null: recorded, never refused.
    max_latency_ratio: Annotated[float, Field(gt=0.0)] | None = None
    # Slices of the test split, each compared on its own: by the document's file (path),
    # its directory or its extension, or by a row's field (field:NAME, JSONL/CSV/Parquet);
    # null: none. get_data records each document's slice, so it reads this key too.
    slice_by: Annotated[str, Field(pattern=SLICE_BY_PATTERN)] | None = "directory"
    # A slice of at least min_slice_units units whose interval lies wholly above
    # +max_slice_regression (worse by more than this) blocks the promotion.
    max_slice_regression: Annotated[float, Field(ge=0.0)] = 0.05
    min_slice_units: Annotated[int, Field(ge=2)] = 10
    # Live traffic (the service's shadow mode, README "A live champion"): with a Prometheus
    # URL, a candidate that passes every rule above must also hold up on the live prompts
    # mirrored to it as the replicas' challenger, which both models scored, in the last
    # shadow_window (a PromQL duration): worse than the champion there by more than
    # max_shadow_regression bits/byte blocks it. Until min_shadow_prompts were scored it is
    # not promoted but made @challenger_alias, which the replicas' challenger follows; a
    # later promote judges it.
    shadow_prometheus_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    challenger_alias: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")] = "challenger"
    shadow_window: Annotated[str, Field(pattern=r"^[1-9][0-9]*[mhdw]$")] = "24h"
    min_shadow_prompts: Annotated[int, Field(ge=1)] = 200
    max_shadow_regression: Annotated[float, Field(ge=0.0)] = 0.0

    @field_validator("challenger_alias")
    @classmethod
    def _challenger_is_not_champion(cls, name: str, info: ValidationInfo) -> str:
        if name == info.data.get("alias"):
            raise ValueError(f"'{name}' is promote.alias too: a waiting candidate needs an alias of its own")
        return name


class MlflowConfig(_Section):
    experiment: Annotated[str, Field(min_length=1)] = "lmops"
    tracking_uri: str = "sqlite:///mlflow.db"
    artifact_location: str = "artifacts/mlruns"


class Params(_Section):
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    promote: PromoteConfig = PromoteConfig()
    mlflow: MlflowConfig = MlflowConfig()


def _field_at(loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, str | None]:
    """The section model holding the key at `loc`, and that key (None when unknown)."""
    section: type[BaseModel] = Params
    for key in loc[:-1]:
        field = section.model_fields.get(str(key))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None, None
        section = field.annotation
    return section, str(loc[-1]) if loc else None


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    section, key = _field_at(loc)
    if err["type"] == "extra_forbidden":
        known = list(section.model_fields) if section else []
        hint = difflib.get_close_matches(key or "", known, n=1)
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
        return f"unknown key '{dotted}'{suggestion}; known keys here: {', '.join(known)}"
    if section is not None and key in section.model_fields:
        annotation = section.model_fields[key].annotation
        choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()
        hint = difflib.get_close_matches(str(err.get("input")).lower(), [str(c) for c in choices], n=1)
        suggestion = f"; did you mean '{hint[0]}'?" if hint else ""
        return f"'{dotted}': {err['msg']} (expected {_type_name(annotation)}, got {err.get('input')!r}{suggestion})"
    return f"'{dotted}': {err['msg']}"


def parse_params(raw: Any, origin: str = PARAMS_FILE) -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise LmopsError(f"{origin}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in _one_per_key(exc.errors()))
        raise LmopsError(f"{origin}: {problems}") from None


def _one_per_key(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A value that fits no member of a union (`model.dropout: lots`) fails each member
    under its own location (`model.dropout.constrained-float`, `...literal['auto']`): one
    error at the key instead, saying what each member wanted."""
    out: dict[tuple, dict[str, Any]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        section, key = _field_at(loc[:2])
        union = (
            len(loc) == 3
            and section is not None
            and key in section.model_fields
            and typing.get_origin(section.model_fields[key].annotation) in (typing.Union, types.UnionType)
        )
        if not union:
            out[loc] = err
        elif loc[:2] in out:
            out[loc[:2]]["msg"] += f", or {err['msg'][0].lower()}{err['msg'][1:]}"
        else:
            out[loc[:2]] = {**err, "loc": loc[:2]}
    return list(out.values())


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise LmopsError(f"{path}: not valid YAML: {exc}") from None


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    path = Path(path)
    if not path.is_file():
        raise LmopsError(f"{path}: params file not found (run from the repository root)")
    return parse_params(_read_yaml(path), str(path))


def update_params(path: str | Path, updates: Any) -> Params:
    """Set dotted keys of a params file, `{"train.muon_lr": 0.01}` (what `dvc exp run -S` does,
    for a Kubeflow sweep's steps): written only when the result is valid, checked as every
    stage checks it. Comments are not kept: the file is dumped again."""
    path = Path(path)
    if updates == {}:  # a pipeline step without overrides
        return load_params(path)
    if not isinstance(updates, dict):
        raise LmopsError(
            f'{path}: expected a JSON object of SECTION.KEY values, e.g. {{"train.muon_lr": 0.01}}'
        )
    raw = (_read_yaml(path) if path.is_file() else None) or {}
    if not isinstance(raw, dict):
        raise LmopsError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    for key, value in updates.items():
        section, _, name = str(key).partition(".")
        if not name or "." in name:
            raise LmopsError(f"{path}: '{key}' is not SECTION.KEY (e.g. train.muon_lr)")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise LmopsError(f"{path}: '{section}' is not a section")
        raw[section][name] = value
    said = ", ".join(f"{k}={v!r}" for k, v in updates.items())
    params = parse_params(raw, f"{path} with {said}")
    atomic.write_text(path, yaml.safe_dump(raw, sort_keys=False))
    log.info("%s: %s", path, said)
    return params
