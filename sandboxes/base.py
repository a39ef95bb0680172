"""The sandbox protocol: where a session's processes run. Session code sees only this page."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

TAIL_BYTES = 16_000


class SandboxError(Exception):
    """A sandbox operation failed for a reason of the sandbox's, not the command's."""


class SandboxStartError(SandboxError):
    """The sandbox never became ready."""

    task_fault = False  # True: the task's own (its image will not build, it asks what the host lacks)


class TaskEnvironmentError(SandboxStartError):
    """The task's environment cannot be had, the same way for every attempt: its image's build failed
    or ran past the task's bound, or it asks for what this host has not (GPUs)."""

    task_fault = True


class SandboxLostError(SandboxError):
    """The sandbox died or became unreachable mid-session."""


class WorkspaceSpec(BaseModel):
    """How the workspace is laid out from a task: inline files, then a local directory or git repo."""

    model_config = ConfigDict(extra="forbid")

    files: dict[str, str] = Field(default_factory=dict)  # relative path -> text
    copy_from: str | None = None  # a local directory or git repository copied in whole


# A grading sandbox's session id: the agent's plus this, so its directory and labels say whose it is; and
# the control sandbox's, that tells whose a failed grading is (executor/grading.py).
REVIEW_SUFFIX = ".review"
CONTROL_SUFFIX = ".control"


class SandboxSpec(BaseModel):
    """What a session asks of its sandbox."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    session_id: str  # the rollout id plus a random suffix: unique per launch (a resume reruns an attempt)
    ttl_s: float = Field(gt=0)  # deadline plus grace: the backstop against a leaked sandbox
    workspace: WorkspaceSpec = Field(default_factory=WorkspaceSpec)
    env: dict[str, str] = Field(default_factory=dict)  # added to the scrubbed base environment
    memory_limit_mb: int | None = None
    # Where the provider runs containers (sandboxes/container.py): the task's image, or a directory with a
    # Dockerfile to build it from, and its CPUs. Providers without images ignore them.
    image: str | None = None
    build_context: str | None = None
    cpus: float | None = None
    # More of a task's environment where the provider runs images (executor/tasks.py's Task says what
    # each is); providers without images ignore them.
    workdir: str | None = None
    user: str | None = None
    allow_internet: bool = False
    build_timeout_s: float | None = None
    storage_mb: int | None = None
    gpus: int = 0


def check_directory_name(label: str, value: str) -> None:
    """``value`` names one directory of the sandbox root, and nothing else."""
    if not value or value in (".", "..") or "/" in value or "\0" in value or len(value) > 200:
        raise SandboxStartError(f"{label} {value!r} cannot name a directory")


def check_session_names(spec: SandboxSpec) -> None:
    """A spec's run and session ids each name one directory of the sandbox root."""
    check_directory_name("run_id", spec.run_id)
    check_directory_name("session_id", spec.session_id)


class ExecResult(BaseModel):
    """What one command did."""

    model_config = ConfigDict(extra="forbid")

    exit_code: int | None  # None when killed by a signal
    signal: int | None = None
    timed_out: bool = False
    duration_s: float
    stdout_path: str | None = None  # full output, capped, where the provider keeps it
    stderr_path: str | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    before: ExecResult | None = None  # the ``before`` step's, when the exec had one
    # Which bound of the sandbox's, other than its timeout, ended it: its disk (then ``timed_out``), or its
    # memory cap (killed by SIGKILL, the kernel's OOM killer: not a signal sent from inside the sandbox).
    limit: str | None = None
    oom_kills: int = 0  # processes of the sandbox its memory cap killed while this command ran


class ExecStep(BaseModel):
    """A command an exec runs to its end before its own, with its own timeout and output files."""

    model_config = ConfigDict(extra="forbid")

    argv: list[str]
    timeout: float
    name: str
    env: dict[str, str] = Field(default_factory=dict)  # added to the exec's environment


@runtime_checkable
class RunsBefore(Protocol):
    """A sandbox whose ``exec`` takes ``before=ExecStep``: two commands for the cost of one exec (one
    supervisor, one round trip). Sandboxes without it run the step as an exec of its own."""

    runs_before: bool


@runtime_checkable
class StopsOnEvent(Protocol):
    """A sandbox whose ``exec`` takes ``expire`` (an ``asyncio.Event``): the command is stopped once it is
    set, its result timed out. Other sandboxes' commands end on their own or at their timeout."""

    stops_on_event: bool


@runtime_checkable
class EndsCommands(Protocol):
    """A sandbox whose processes can all be ended before its stop, its files kept until then
    (``end_commands``): a session ends the agent's once its harness has, before the grading."""

    async def end_commands(self) -> None: ...


@runtime_checkable
class StartsInMilliseconds(Protocol):
    """A provider whose sandboxes start in milliseconds: a session starts its grading sandbox beside the
    harness, where one that takes a while (a container, a job) is started as soon as the agent's is up."""

    starts_in_milliseconds: bool


@runtime_checkable
class Sandbox(Protocol):
    """A started sandbox. All paths are inside the sandbox; ``workdir`` is the task's workspace.

    ``isolation_label``, ``gateway_url``, ``check_runs`` and ``python_argv`` are optional: ``None`` where
    the sandbox has no such part, and the session then does without it."""

    id: str
    workdir: str
    home: str
    # The layers its commands run under (``Row.sandbox_isolation``), where the sandbox itself knows them: a
    # remote agent says once it has answered. None: its provider's ``isolation_label`` stands.
    isolation_label: str | None
    # The gateway's URL as its commands reach it, where that differs from the worker's: a remote sandbox's
    # network namespace reaches it at 127.0.0.1 through its agent. ``gateway_url(url, other_port)``: the
    # gateway's port for the connections its harness's process did not open (sandboxes/netns.py), if any.
    # None: the URL as it is.
    gateway_url: Callable[[str, int | None], str] | None
    # ``check_runs(program, what)``: SandboxError, one line, unless ``program`` starts here; for a sandbox
    # of a task's own image, which may lack what a harness needs. None: the sandbox does not check.
    check_runs: Callable[[str, str], Awaitable[None]] | None
    # The interpreter our in-sandbox scripts run with, where the sandbox carries one of its own (a
    # container's, sandboxes/runtime.py). None: the image's ``python3``.
    python_argv: list[str] | None
    # Whether its commands see the worker's own userland (its node, its python): a harness then starts
    # its entry script with them; a container of a task's image has only what the image has.
    shares_host_userland: bool

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        name: str = "exec",
    ) -> ExecResult: ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def read_file(self, path: str, limit: int) -> bytes: ...

    async def copy_in(self, src: Path, dest: str | None = None) -> None: ...

    async def stop(self) -> None: ...

    def descriptor(self) -> dict[str, Any]: ...


@runtime_checkable
class HidesPaths(Protocol):
    """A provider whose sandboxes see the worker's host: ``hide`` keeps a path (the run's directory)
    out of their sight."""

    def hide(self, path: Path) -> None: ...


class SandboxProvider(Protocol):
    name: str
    # The layers its sandboxes' commands run under, where the provider knows them before any starts (a
    # local one makes them itself). None: each sandbox says (``Sandbox.isolation_label``), or none is known.
    isolation_label: str | None

    async def start(self, spec: SandboxSpec) -> Sandbox: ...
