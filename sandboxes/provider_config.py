"""What every provider's YAML section shares, and the three things each section does: say where its
sandboxes' directories go, build its provider and reap what dead owners left. ``executor.config`` joins the
sections into one union keyed by ``provider``, so the caller never switches on the provider's name."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sandboxes.base import SandboxProvider
from sandboxes.cache_root import default_cache_root

# The gateway's port and Unix socket, for sandboxes whose commands run in network namespaces of their own
# (sandboxes/netns.py): 127.0.0.1:port inside reaches the gateway through the socket.
NetworkForward = tuple[int, str]


class ProviderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root: str | None = None  # default: <cache>/sandboxes; remote providers need it on a shared filesystem
    keep: bool = False  # keep each session's directory after the rollout
    # Chaos testing only: this fraction of sandbox starts fails on purpose (sandboxes/testing/faults.py).
    inject_start_failures: float = Field(default=0.0, ge=0, le=1)
    # The address the worker's model gateway binds, which sandboxes dial. 127.0.0.1 serves sandboxes on
    # the worker's own host; sandboxes on other machines need a routable address of the worker's node
    # ("node-ip": the address Ray knows the node by).
    gateway_host: str = "127.0.0.1"

    def root_dir(self) -> Path:
        """Where each run's directory (its sessions, its prepared workspaces) and the owner records go:
        ``root``, else ``<cache>/sandboxes``. The worker builds its provider there and the reaper looks
        there."""
        return Path(self.root) if self.root else default_cache_root() / "sandboxes"

    @property
    def needs_gateway_socket(self) -> bool:
        """Whether sandboxes reach the gateway only through a Unix socket; ``build`` then gets the
        gateway's ``NetworkForward``."""
        return False

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> SandboxProvider:
        """The provider, its sessions' directories under ``root``. ``network_forward`` is given when
        ``needs_gateway_socket`` says so, and is None otherwise."""
        raise NotImplementedError

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        """End sandboxes whose owner died or whose TTL passed (``everything``: all of ``run_id``'s).
        Returns what was ended; idempotent; blocking, so call it in a thread from async code."""
        raise NotImplementedError
