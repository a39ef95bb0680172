"""One task: what one rollout is asked to do (``Task``, with its ``Verifier``), and ``InputError``, the
one-line error of bad user input. Loading them from files is executor/tasks.py's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandboxes.base import WorkspaceSpec
from sandboxes.workspace import WorkspaceError, checked_relative_path


class InputError(Exception):
    """Bad user input (a task file, a config): one line saying where and what."""


class Verifier(BaseModel):
    """A command run after the harness in a fresh sandbox holding the agent's final workspace; exit 0
    means reward 1.0 (the whole contract: docs/configuration.md, "The verifier")."""

    model_config = ConfigDict(extra="forbid")

    command: str
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # Re-runs, in the same sandbox, of a verifier that could not grade (error or timeout) before the
    # attempt is given up: the agent's work is not thrown away for the grader's hiccup.
    retries: int = Field(default=1, ge=0, le=5)
    # Harbor's contract (executor/harbor.py): this directory is uploaded to /tests after the agent's
    # session, and the reward is read from /logs/verifier, not from the exit code.
    tests_dir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)  # added to the verifier's environment
    user: str | None = None  # the user the tests run as, where the provider runs images (else root)
    # Which metric of a Harbor reward.json is the row's reward; every metric goes to ``rewards``.
    reward_key: str = "reward"
    # The task's hidden checks (relative path -> text): written into the workspace only in the grading
    # sandbox, after the diff and over whatever the agent left at those paths; the agent never sees them.
    files: dict[str, str] = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, value: dict[str, str]) -> dict[str, str]:
        try:
            return {checked_relative_path(rel): text for rel, text in value.items()}
        except WorkspaceError as exc:
            raise ValueError(str(exc)) from None


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=200)
    prompt: str = Field(min_length=1)
    workspace: WorkspaceSpec = Field(default_factory=WorkspaceSpec)
    verify: Verifier | None = None
    deadline_s: float | None = Field(default=None, gt=0, le=86_400)
    # The built-in scripted model plays these steps for every attempt of this task; a real endpoint
    # ignores them.
    model_script: list[dict[str, Any]] | None = None
    harness: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # The task's environment, on providers that run images (sandbox.provider 'container'): an image, or
    # a directory holding a Dockerfile to build one from (once per distinct content), and its resources.
    image: str | None = Field(default=None, min_length=1, max_length=1000)
    build: str | None = Field(default=None, min_length=1)
    cpus: float | None = Field(default=None, gt=0, le=1024)
    memory_mb: int | None = Field(default=None, gt=0)
    # More of the environment, on providers that run images: the workspace's path in the image (else its
    # WORKDIR), the user the agent's commands run as, a network with egress (else none but the gateway),
    # environment variables for every command, the image build's bound, a disk quota, GPUs.
    workdir: str | None = Field(default=None, pattern=r"^/")
    user: str | None = Field(default=None, min_length=1, max_length=64)
    allow_internet: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    build_timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    storage_mb: int | None = Field(default=None, gt=0)
    gpus: int = Field(default=0, ge=0, le=64)
    # Set by a loader for a task it could read only in part (a Harbor task missing a file): why it
    # cannot run. Its attempt fails at set-up with this line, and the other tasks go on.
    invalid: str | None = None

    def sandbox_request(self) -> dict[str, Any]:
        """What of this task a ``SandboxSpec`` carries: its environment."""
        return {
            "image": self.image,
            "build_context": self.build,
            "cpus": self.cpus,
            "memory_limit_mb": self.memory_mb,
            "workdir": self.workdir,
            "user": self.user,
            "allow_internet": self.allow_internet,
            "env": dict(self.env),
            "build_timeout_s": self.build_timeout_s,
            "storage_mb": self.storage_mb,
            "gpus": self.gpus,
        }

    @field_validator("verify", mode="before")
    @classmethod
    def _verify_shorthand(cls, value: Any) -> Any:
        return {"command": value} if isinstance(value, str) else value

    @field_validator("id")
    @classmethod
    def _safe_id(cls, value: str) -> str:
        if "/" in value or value in (".", "..") or "\x00" in value:
            raise ValueError("must not contain '/' or be '.' or '..'")
        return value
