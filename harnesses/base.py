"""The harness protocol and the normalized transcript every adapter produces."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from policy import FailureKind
from sandboxes.base import ExecResult, Sandbox


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    call_id: str | None = None
    arguments: str | None = None  # bounded JSON text
    status: Literal["completed", "failed", "unknown"] = "unknown"
    exit_code: int | None = None
    output: str | None = None  # bounded


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "tool", "system"]
    text: str = ""


class Usage(BaseModel):
    """Token counts; None means unknown, never 0."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_input_tokens: int | None = None
    reasoning_tokens: int | None = None


class HarnessReport(BaseModel):
    """What an adapter read from the harness's own evidence (event stream, native transcript)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    final_text: str | None = None
    # The harness's own claim of failure, if it made one, as recognized by its adapter.
    claimed_failure: FailureKind | None = None
    claimed_message: str | None = None
    evidence_gaps: list[str] = Field(default_factory=list)  # e.g. "transcript_unavailable"
    native_transcript_path: str | None = None
    # How often the harness said it re-sent a model request on its own; None when it does not say.
    reconnects: int | None = None


class LaunchContext(BaseModel):
    """Everything an adapter needs to launch one session."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    base_url: str  # the gateway's per-session prefix, ending in /v1
    api_key: str  # the session token; never the real key
    model: str
    prompt: str
    install_dir: Path  # where ensure_installed put this version
    max_output_tokens: int | None = None


# The wire API a harness speaks to the model: the Responses API or Chat Completions.
HarnessApi = Literal["responses", "chat"]


class Launch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    stdin: bytes | None = None


class Harness(Protocol):
    """A spec sheet of one CLI: version, install, launch, parse, recognize."""

    name: str
    tested_version: str
    version: str
    # Which API the harness calls, so a preflight can try that one; None when it cannot be known.
    api: HarnessApi | None

    def ensure_installed(self, cache_root: Path) -> Path: ...

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch: ...

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport: ...


_warned: set[tuple[str, str]] = set()


def warn_if_untested(name: str, version: str, tested: str, known: tuple[str, ...]) -> None:
    """Warn once per (harness, version) that is not the tested pin: warn, never refuse."""
    if version == tested or (name, version) in _warned:
        return
    _warned.add((name, version))
    logging.getLogger(f"harnesses.{name}").warning(
        "%s %s is configured but %s is the tested version (known to work: %s); running it anyway",
        name,
        version,
        tested,
        ", ".join(known),
    )
