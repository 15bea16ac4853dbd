"""The one validated configuration object (pydantic), read from TOML and overridden by CLI flags.

Unknown keys are errors at every level, so a typo never silently does nothing. See
docs/config.md and docs/example-deploy.toml."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Strict):
    name: Optional[str] = Field(None, description="preset name (e.g. smollm2-135m) or a checkpoint path")
    random_weights: bool = Field(False, description="random weights of the preset's exact shapes")
    context_length: Optional[int] = Field(None, ge=16, description="KV cache length (default: min(model, 8192))")
    weight_dtype: str = Field("bf16", pattern="^(bf16|f16|f32)$", description="dtype of random weights")
    seed: int = Field(0, description="seed for random weights")


class BackendSection(_Strict):
    name: Optional[str] = Field(None, description="backend plugin name (default: best available)")
    options: dict[str, Any] = Field(default_factory=dict, description="backend-specific options")


class ParallelSection(_Strict):
    ranks: int = Field(1, ge=1, le=64, description="ranks (GPUs or CPU workers); must divide the lanes")
    collective: str = Field("cpu_threads", description="collective plugin used between ranks")


class SamplingSection(_Strict):
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)


class ServerSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    queue_size: int = Field(16, ge=1, description="requests waiting beyond the one running; more get 429")
    max_body_bytes: int = Field(1 << 20, ge=1024)
    stats_interval_s: float = Field(60.0, gt=0)
    prefix_reuse: bool = Field(True, description="reuse the KV cache the previous request's prompt + output left "
                               "(a shared prefix runs once); false: every request runs its whole prompt")


class KogConfig(_Strict):
    model: ModelSection = Field(default_factory=ModelSection)
    backend: BackendSection = Field(default_factory=BackendSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    server: ServerSection = Field(default_factory=ServerSection)

    @field_validator("model", "backend", "parallel", "sampling", "server", mode="before")
    @classmethod
    def _none_is_default(cls, v):
        return {} if v is None else v


def format_validation_error(e: ValidationError, source: str) -> list[str]:
    """One line per problem, each with its dotted key path."""
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/config.md)"
        lines.append(f"{source}: {path}: {msg}")
    return lines


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass an existing TOML file to --config")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not UTF-8 text")


def validate_dict(data: dict, source: str = "config") -> tuple[KogConfig | None, list[str]]:
    try:
        return KogConfig.model_validate(data), []
    except ValidationError as e:
        return None, format_validation_error(e, source)


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> KogConfig:
    """Read the file (if any), apply overrides ({"model": {"name": ...}, ...}; None values are
    ignored), validate. All problems are reported at once, in a single line."""
    data = read_toml(path) if path else {}
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is not None:
                data.setdefault(section, {})
                if not isinstance(data[section], dict):
                    break
                data[section][key] = value
    cfg, problems = validate_dict(data, str(path) if path else "options")
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg
