"""Service settings from the environment (pydantic-settings), shared by `create_app`
and gunicorn.conf.py, so the app and the server never disagree on a default.

`HOST` and `PORT`, `LMOPS_<NAME>` for every service field, and `LMOPS_<FIELD>` for
every field of `lmops.runtime.engine.EngineConfig` (LMOPS_DEVICE, LMOPS_BLOCK_SIZE,
LMOPS_MAX_NUM_SEQS, ...): a field added to EngineConfig is a setting here with no
change to this file.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from pathlib import Path
from typing import Any

from pydantic import Field, FilePath, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from lmops.errors import LmopsError
from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.generation_config import SAMPLING_KEYS
from production_service.model_source import default_model_cache

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"
ENV_PREFIX = "LMOPS_"
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


class ServiceConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid", validate_by_name=True
    )

    host: str = Field("0.0.0.0", validation_alias="HOST")
    port: int = Field(5001, ge=0, validation_alias="PORT")
    # /health, /ready, /metrics, /openapi.json on their own port and threads
    # (0 = none), so probes answer while every request thread is taken.
    probe_port: int = Field(5002, ge=0)
    model_dir: Path = DEFAULT_MODEL_DIR
    model_uri: str | None = None  # e.g. models:/lmops@champion; wins over model_dir
    # Where model_uri downloads are kept, one directory per model version (model_source.py).
    model_cache: Path = Field(default_factory=default_model_cache)
    # How often a replica looks for a new version of a model that can move (a registry
    # alias, an export's `.current` link) and swaps it in without a restart (follow.py);
    # 0 = never: the model loaded at start is served until the process ends.
    model_poll_s: float = Field(5.0, ge=0)
    # An optional second model in the same process, addressable as `<name>@challenger`:
    # a registry URI (e.g. models:/lmops@challenger; wins) or a model directory.
    challenger_uri: str | None = None
    challenger_dir: Path | None = None
    # The share of the champion's prompts mirrored to the challenger, both scoring them in
    # bits/byte (lmops:shadow_prompt_bits_per_byte); the mirror's answers are discarded.
    shadow_share: float = Field(0.0, ge=0, le=1)
    api_key: str | None = None
    threads: int | None = Field(None, ge=1)  # None: enough for every running and queued request
    timeout: int = Field(120, ge=1)
    graceful_timeout: int = Field(30, ge=1)
    # A client must send its request line and headers within this many seconds of its
    # first byte, or its connection is closed (frees the thread a trickling client holds).
    header_timeout: float = Field(10.0, gt=0)
    # The body must follow within this many seconds of the head (and pause no longer
    # than the 5 s keep-alive), or the client gets a 408 and its connection is closed.
    body_timeout: float = Field(10.0, gt=0)
    max_queued: int = Field(64, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # Request defaults over the model's generation_config.json, e.g. '{"temperature": 0}'
    # (vLLM's --override-generation-config); a request's own values win over both.
    generation_config: dict[str, Any] = Field(default_factory=dict)
    chat_template: FilePath | None = None  # a Jinja file used instead of the model's chat template
    # gunicorn.conf.py sets it: a worker that cannot load its model exits with
    # gunicorn's WORKER_BOOT_ERROR, so the master halts instead of respawning it.
    exit_on_load_failure: bool = False

    @model_validator(mode="before")
    @classmethod
    def _engine_fields_at_top_level(cls, data: Any) -> Any:
        """`ServiceConfig(device="cpu")` sets `engine.device`, as LMOPS_DEVICE does."""
        if isinstance(data, dict) and any(k in data for k in _ENGINE_FIELDS):
            data = dict(data)
            engine = data.get("engine") or {}
            engine = dataclasses.asdict(engine) if isinstance(engine, EngineConfig) else dict(engine)
            engine.update({k: data.pop(k) for k in _ENGINE_FIELDS if k in data})
            data["engine"] = engine
        return data

    @model_validator(mode="after")
    def _shadow_needs_a_challenger(self) -> ServiceConfig:
        if self.shadow_share > 0 and not (self.challenger_uri or self.challenger_dir):
            raise ValueError(
                "shadow_share mirrors prompts to the challenger: set LMOPS_CHALLENGER_URI or "
                "LMOPS_CHALLENGER_DIR, or leave LMOPS_SHADOW_SHARE at 0"
            )
        return self

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: str | None) -> str | None:
        """A key no client could send would lock everyone out; an empty one (an empty
        Secret) must not quietly mean "no key"."""
        if value is None:
            return value
        if not value.strip():
            raise ValueError("empty or blank; unset it to serve without a key")
        if not (value.isascii() and value.isprintable()) or any(c.isspace() for c in value):
            raise ValueError(
                "must be printable ASCII without spaces (clients send `Authorization: Bearer <key>`)"
            )
        return value

    @field_validator("generation_config")
    @classmethod
    def _generation_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"unknown key {unknown[0]!r}; the sampling defaults it may set are {sorted(SAMPLING_KEYS)}"
            )
        return value

    def authorizes(self, authorization: str) -> bool:
        """Whether an Authorization header value carries the key (`Bearer <key>`), compared
        in constant time; anything does when no key is set."""
        if self.api_key is None:
            return True
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    @property
    def worker_threads(self) -> int:
        """A thread per running and queued request (plus a few), so a full queue
        answers 429 instead of leaving connections waiting for a thread."""
        return self.threads or self.engine.max_num_seqs + self.max_queued + 8

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, *args, **kwargs):
        return init_settings, env_settings, _EngineEnv(settings_cls), _ApiKeyEnv(settings_cls)

    @classmethod
    def from_env(cls) -> ServiceConfig:
        """The settings, or one line naming the variable that is wrong."""
        try:
            return cls()
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            message = error["msg"].removeprefix("Value error, ")
            raise LmopsError(f"{_env_name(error['loc'], message)}: {message}") from None


class _EngineEnv(PydanticBaseSettingsSource):
    """LMOPS_<FIELD> for every EngineConfig field."""

    def get_field_value(self, field, field_name):  # the whole `engine` dict comes from __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = {}
        for name in _ENGINE_FIELDS:
            value = os.environ.get(ENV_PREFIX + name.upper(), "").strip()
            if value:
                values[name] = value
        return {"engine": values} if values else {}


class _ApiKeyEnv(PydanticBaseSettingsSource):
    """LMOPS_API_KEY when set but empty, which env_ignore_empty would drop (turning an
    empty Secret into "no key"), so the validator refuses it."""

    def get_field_value(self, field, field_name):
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        key = os.environ.get(ENV_PREFIX + "API_KEY")
        return {} if key is None else {"api_key": key}


def _env_name(loc: tuple, message: str) -> str:
    """The variable behind a validation error's location."""
    if loc[:1] == ("engine",):
        # an EngineConfig.__post_init__ error names the field first in its message
        name = loc[1] if len(loc) > 1 else message.split(" ")[0]
        return ENV_PREFIX + str(name).upper()
    # a field's name or its alias (HOST, PORT); a model validator's error names the field first
    name = str(loc[0]) if loc else message.split(" ")[0]
    if not loc and name not in ServiceConfig.model_fields:
        return "settings"
    return ENV_PREFIX + name.upper() if name in ServiceConfig.model_fields else name
