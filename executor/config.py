"""The run configuration: YAML validated by pydantic, so a typo is an error that names the key."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from executor.admission import AdmissionConfig
from executor.input_text import load_yaml
from executor.storage import is_object_uri
from executor.tasks import InputError, location_of
from harnesses.gateway import GatewayConfig
from harnesses.registry import HARNESSES
from policy import PolicyConfig
from sandboxes.container import ContainerSandboxConfig
from sandboxes.ecs import EcsSandboxConfig
from sandboxes.local_config import LocalSandboxConfig
from sandboxes.slurm import SlurmSandboxConfig


class HarnessConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "codex"
    version: str | None = None  # None: the adapter's tested pin
    command: str | None = None  # the `command` harness only: the shell command that is the agent
    # Which processes of the sandbox may call the model: the harness's one (the first to connect; the
    # agent's tools and scripts are refused, so they cannot draw upstream failures that mask the row), or
    # any, for a `command` agent that calls the model from several processes (docs/configuration.md).
    model_client: Literal["one_process", "any_process"] = "one_process"

    @model_validator(mode="after")
    def _known(self) -> HarnessConfig:
        if self.name not in HARNESSES:
            raise ValueError(f"unknown harness {self.name!r}; known: {', '.join(sorted(HARNESSES))}")
        if self.command is not None and self.name != "command":
            raise ValueError(f"harness.command applies to the 'command' harness, not {self.name!r}")
        return self


class ModelConfig(BaseModel):
    """The endpoint. ``scripted`` runs the built-in scripted model inside each worker."""

    model_config = ConfigDict(extra="forbid")

    provider: Literal["scripted", "openai"] = "scripted"
    # Required for openai; ends in /v1. Several: replicas of one model server, each session kept on one
    # (harnesses/gateway/upstreams.py).
    base_url: str | list[str] | None = None
    api_key_env: str | None = None  # the variable holding the key; the key itself never enters config
    name: str = "scripted-model"  # every model call goes upstream with this name, whatever a harness sent
    max_output_tokens: int | None = Field(default=None, ge=1)  # None: the gateway's max_output_tokens
    # Request parameters set on every model call over what the harness sent (temperature, top_p,
    # service_tier, a server's own such as top_k): the only way a tier or routing option goes upstream.
    parameters: dict[str, Any] = Field(default_factory=dict)
    # Sent upstream with the session's id on each of its requests, for a router that keeps a session on
    # one replica by a header (e.g. x-session-affinity); None sends none.
    affinity_header: str | None = Field(default=None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    replica_failures: int = Field(default=3, ge=1, le=1000)  # failed attempts in a row take a replica out
    replica_cooldown_s: float = Field(default=30.0, ge=0, le=86_400)  # ... for this long

    @model_validator(mode="after")
    def _endpoint(self) -> ModelConfig:
        if self.provider == "openai" and not self.base_url:
            raise ValueError("model.base_url is required when model.provider is 'openai'")
        owned = sorted(set(self.parameters) & _HARNESS_OWNED)
        if owned:
            raise ValueError(
                f"model.parameters: {', '.join(owned)} belong to the harness's request, not the run"
            )
        if self.provider == "scripted" and isinstance(self.base_url, list):
            raise ValueError("model.base_url: the scripted model runs in each worker; it takes no URLs")
        return self

    @property
    def base_urls(self) -> list[str]:
        """The replicas' base URLs, in the order given."""
        if self.base_url is None:
            return []
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    def pins(self) -> dict[str, Any]:
        """What the gateway pins on every model call (``Gateway(url, key, config, **model.pins())``)."""
        return {
            "model": self.name,
            "max_output_tokens": self.max_output_tokens,
            "parameters": self.parameters,
        }

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        value = os.environ.get(self.api_key_env)
        if value is None:
            raise InputError(f"model.api_key_env: environment variable {self.api_key_env} is not set")
        return value


# The parts of a model call that are the conversation itself, not a setting of the run's.
_HARNESS_OWNED = frozenset({"model", "messages", "input", "instructions", "tools", "stream"})


def _provider_of(value: Any) -> str | None:
    # A section without ``provider`` is local, as it was before there were other providers.
    if isinstance(value, dict):
        return value.get("provider", "local")
    return getattr(value, "provider", None)


# One section per provider, told apart by ``provider``, each next to its provider (sandboxes/<provider>.py,
# on the shared base sandboxes/provider_config.py): each says where its sandboxes go, builds its provider
# and reaps its leftovers.
SandboxConfig = Annotated[
    Annotated[LocalSandboxConfig, Tag("local")]
    | Annotated[SlurmSandboxConfig, Tag("slurm")]
    | Annotated[EcsSandboxConfig, Tag("ecs")]
    | Annotated[ContainerSandboxConfig, Tag("container")],
    Discriminator(_provider_of),
]


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deadline_s: float = Field(default=600.0, gt=0, le=86_400)  # harness end-to-end, per task unless set
    grace_s: float = Field(default=10.0, ge=0, le=600)
    setup_timeout_s: float = Field(default=900.0, gt=0)
    # wall: the deadline is wall time. agent: time a model request was outstanding is not charged to the
    # agent, so a slow shared endpoint does not eat the agent's time; the harness still ends at max_wall_s.
    deadline_counts: Literal["wall", "agent"] = "wall"
    max_wall_s: float | None = Field(default=None, gt=0, le=259_200)  # agent mode; default 3x the deadline

    def wall_s(self, deadline_s: float) -> float:
        """How long the harness may run, in wall time, for a session with this deadline."""
        if self.deadline_counts == "wall":
            return deadline_s
        return max(self.max_wall_s or 3 * deadline_s, deadline_s)


class ConcurrencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workers: int = Field(default=2, ge=1, le=10_000)  # SandboxWorker actors
    sessions_per_worker: int = Field(default=4, ge=1, le=10_000)
    max_in_flight: int | None = Field(default=None, ge=1)  # default: workers * sessions_per_worker
    # Custom Ray resources each SandboxWorker asks for, e.g. {sandbox_slot: 1}: on a cluster whose worker
    # nodes advertise them, this keeps sandboxes off the head and spreads them by each node's slots.
    worker_resources: dict[str, float] = Field(default_factory=dict)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str | None = None  # default: the config file's stem, so the same command resumes
    # The task file `rollout run` runs; a trainer's run may have none and submit tasks (executor/api.py).
    tasks: str | None = None
    out: str = "runs"
    samples: int = Field(default=1, ge=1, le=10_000)
    # Which metric of a Harbor task's reward.json is the row's reward (all go to the rewards column).
    reward_key: str = Field(default="reward", min_length=1, max_length=200)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sandbox: SandboxConfig = Field(default_factory=LocalSandboxConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    # The Ray cluster to join; "local": a local one of the run's own. None: RAY_ADDRESS if set, else a
    # local one of its own (executor/cluster.py).
    ray_address: str | None = None

    @model_validator(mode="after")
    def _agent_time_needs_a_local_sandbox(self) -> RunConfig:
        if self.limits.deadline_counts == "agent" and self.sandbox.provider != "local":
            raise ValueError(
                f"limits.deadline_counts: 'agent' needs sandbox.provider 'local' (not yet "
                f"{self.sandbox.provider!r}); use 'wall'"
            )
        return self

    @property
    def in_flight_cap(self) -> int:
        c = self.concurrency
        return c.max_in_flight or c.workers * c.sessions_per_worker


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    where = location_of(first["loc"])
    allowed = _keys_at(first["loc"][:-1]) if first["type"] == "extra_forbidden" else None
    if allowed:
        close = difflib.get_close_matches(str(first["loc"][-1]), allowed, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{where}: {first['msg']} (an unknown key); {hint}allowed here: {_listed(allowed)}"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {str(value)[:80]!r})"
    return f"{where}: {first['msg']}{shown}"


ALLOWED_SHOWN_CHARS = 240  # a section with many keys (gateway:) is listed in part, the error one line


def _listed(keys: list[str]) -> str:
    text = ", ".join(keys)
    if len(text) <= ALLOWED_SHOWN_CHARS:
        return text
    shown = text[:ALLOWED_SHOWN_CHARS].rsplit(", ", 1)[0]
    return f"{shown}, ... ({len(keys)} keys in all: docs/configuration.md)"


def _keys_at(loc: tuple[Any, ...]) -> list[str] | None:
    """The keys the config accepts at ``loc``, so a typo's error can list them."""
    model: Any = RunConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return list(model.model_fields)


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read and validate a run config; relative paths in it are relative to the file."""
    try:
        raw = load_yaml(path.read_text()) or {}
    except FileNotFoundError:
        raise InputError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: the config must be a mapping of keys")
    raw.setdefault("run_id", path.stem)
    for key in ("tasks", "out"):
        if isinstance(raw.get(key), str):
            raw[key] = local_path(raw[key], f"{path}: {key}", objects_ok=key == "out")
            if not is_object_uri(raw[key]) and not Path(raw[key]).is_absolute():
                raw[key] = str((path.parent / raw[key]).resolve())
    return config_from(raw, str(path), overrides)


def config_from(raw: dict[str, Any], where: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Validate a config's keys (``overrides``: dotted keys set first); one line naming ``where`` and
    the key when they are wrong."""
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise InputError(f"{where}: {_describe(exc)}") from None


_URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(value: str, where: str, *, objects_ok: bool = False) -> str:
    """A path given as a path or a ``file://`` URI, as a path; with ``objects_ok`` an object-store URI
    (``s3://``, ``gs://``: executor/storage.py) as it is. Any other URI is refused: taken as a path it
    would quietly become a local directory named ``s3:``, and the run would look written."""
    match = _URI_RE.match(value)
    if match is None or (objects_ok and is_object_uri(value)):
        return value
    if match.group(1).lower() == "file":
        return value[len(match.group(0)) :] or "/"
    instead = "a path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX" if objects_ok else "a path"
    raise InputError(f"{where} {value[:200]}: {match.group(1)}:// storage is not supported; give {instead}")


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value
