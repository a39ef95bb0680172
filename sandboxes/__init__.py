"""Where a session's processes run: the protocol, the local provider, workspace lay-out."""

from sandboxes.base import (
    TAIL_BYTES,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLostError,
    SandboxProvider,
    SandboxSpec,
    SandboxStartError,
    WorkspaceSpec,
)
from sandboxes.local import LocalSandbox, LocalSandboxProvider, reap_stale
from sandboxes.workspace import WorkspaceError, lay_out, workspace_diff

__all__ = [
    "TAIL_BYTES",
    "ExecResult",
    "LocalSandbox",
    "LocalSandboxProvider",
    "Sandbox",
    "SandboxError",
    "SandboxLostError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxStartError",
    "WorkspaceError",
    "WorkspaceSpec",
    "lay_out",
    "reap_stale",
    "workspace_diff",
]
