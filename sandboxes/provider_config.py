"""What every provider's YAML section shares, and the two things each section must do: build its
provider and reap what dead owners left. ``executor.config`` joins the sections into one union keyed by
``provider``, so the caller never switches on the provider's name."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sandboxes.base import SandboxProvider


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

    def build(self, root: Path) -> SandboxProvider:
        raise NotImplementedError

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        """End sandboxes whose owner died or whose TTL passed (``everything``: all of ``run_id``'s).
        Returns what was ended; idempotent; blocking, so call it in a thread from async code."""
        raise NotImplementedError
