"""The ``local`` provider's section of a run config (``sandbox:``): its layers and bounds, resolved against
this host (sandboxes/isolation.py), and the provider it builds (sandboxes/local.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sandboxes import isolation, pidlimit
from sandboxes.isolation import Choice, IsolationMode
from sandboxes.local_reap import reap_stale
from sandboxes.provider_config import NetworkForward, ProviderConfig

if TYPE_CHECKING:  # it imports this module: the provider is imported where it is built
    from sandboxes.local import LocalSandboxProvider


DEFAULT_MAX_FILE_MB = 4096
# A runaway of many files stops here, well above a repository with its dependencies installed; the
# watcher's walks are then at most MAX_DELAY_S apart (sandboxes/diskbound.py).
DEFAULT_MAX_DISK_MB = 10240
# A sandbox's memory, its processes' and the files they write to its tmpfs together (a memory cgroup, root
# only), unless its task says (``memory_mb``). Its disk is a tmpfs of max_disk_mb whose pages count here
# too: the tighter bound holds.
DEFAULT_MAX_MEMORY_MB = 8192


class Mount(BaseModel):
    """A host path a sandbox's commands see (``sandbox.mounts``): read-only unless ``writable``."""

    model_config = ConfigDict(extra="forbid")

    path: str
    writable: bool = False

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not os.path.isabs(value) or "\0" in value:
            raise ValueError(f"sandbox.mounts: {value!r} is not an absolute path")
        if not os.path.exists(value):
            raise ValueError(f"sandbox.mounts: {value!r} does not exist on this host")
        return os.path.normpath(value)


class LocalSandboxConfig(ProviderConfig):
    provider: Literal["local"] = "local"
    # auto: every layer below this host allows (a network namespace reaching only the gateway, a PID
    # namespace, the filesystem view, the unprivileged user), saying once in one line which it cannot;
    # strict: all of them, or the run does not start; off: the host's network and filesystem and the
    # worker's user, a PID namespace where the host allows. See sandboxes/isolation.py, docs/isolation.md.
    isolation: IsolationMode = "auto"
    # Each layer on its own; unset: as ``isolation`` says. isolated: every command in a loopback-only
    # network namespace of its own, which reaches the gateway (and nothing else) through the gateway's Unix
    # socket (sandboxes/netns.py).
    network: Literal["host", "isolated"] | None = None
    # isolated: a PID namespace per sandbox, so /proc shows only the sandbox's own processes (not the
    # worker's, whose environment holds the API key); auto: isolated when this host allows it.
    pids: Literal["auto", "host", "isolated"] | None = None
    # readonly: the host read-only, homes, /root, /tmp, the run directory and other sandboxes hidden, only
    # the session's own directories writable (sandboxes/fsview.py).
    filesystem: Literal["host", "readonly"] | None = None
    # More paths no sandboxed command may see inside what it sees (the run and sandbox roots, /etc's
    # secrets are hidden already; what is not bound in is not there at all).
    hide: list[str] = Field(default_factory=list)
    # Host paths the filesystem view binds in besides the system directories, the harness cache and the
    # session's own: a path (read-only), or {path, writable}. Everything else of the host is not there.
    mounts: list[Mount] = Field(default_factory=list)
    # Bounds on what one sandbox's commands can take from the host, unset: as ``isolation`` says (off:
    # none). Processes and threads of the whole sandbox (a pids cgroup, root only: sandboxes/pidlimit.py),
    # and the size of any one file a command writes (RLIMIT_FSIZE).
    max_processes: int | None = Field(default=None, gt=0)
    max_file_mb: int | None = Field(default=None, gt=0)
    # The disk a sandbox's files take in total (work, home, tmp), however many: past it, the running
    # command ends as timed out (sandboxes/diskbound.py). Unset: DEFAULT_MAX_DISK_MB (off: no bound).
    max_disk_mb: int | None = Field(default=None, gt=0)
    # A sandbox's memory (a memory cgroup, root only), unless its task says: past it the kernel kills a
    # process of the sandbox, and the command's result says so (``ExecResult.oom_kills``). Unset:
    # DEFAULT_MAX_MEMORY_MB (off: none).
    max_memory_mb: int | None = Field(default=None, gt=0)
    _layers: Choice | None = PrivateAttr(default=None)

    @field_validator("mounts", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("isolation", mode="before")
    @classmethod
    def _off_in_yaml(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _can_isolate(self) -> LocalSandboxConfig:
        try:
            self._layers = isolation.choose(self.isolation, self.network, self.pids, self.filesystem)
        except isolation.IsolationUnavailable as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def layers(self) -> Choice:
        assert self._layers is not None  # set by the validator
        return self._layers

    @property
    def needs_gateway_socket(self) -> bool:
        return self.layers.network

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> LocalSandboxProvider:
        if self.layers.network and network_forward is None:
            raise ValueError("sandbox.network 'isolated' needs the gateway's port and Unix socket")
        from sandboxes.local import LocalSandboxProvider

        layers = self.layers
        return LocalSandboxProvider(
            root,
            keep=self.keep,
            network_forward=network_forward if layers.network else None,
            pids="isolated" if layers.pids else "host",
            filesystem="host" if layers.filesystem == "host" else "readonly",
            user=layers.user,
            hidden=self.hide,
            max_processes=self.max_processes or (None if self.isolation == "off" else pidlimit.DEFAULT_LIMIT),
            max_file_mb=self.max_file_mb or (None if self.isolation == "off" else DEFAULT_MAX_FILE_MB),
            max_disk_mb=self.max_disk_mb or (None if self.isolation == "off" else DEFAULT_MAX_DISK_MB),
            max_memory_mb=self.max_memory_mb or (None if self.isolation == "off" else DEFAULT_MAX_MEMORY_MB),
            mounts=[(m.path, m.writable) for m in self.mounts],
        )

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        # A local sandbox's owner is a process on this host: a crashed run's owners are all dead.
        return reap_stale(root, run_id)
