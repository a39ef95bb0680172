"""SandboxWorker: an async Ray actor hosting many sessions, one gateway and (for demos) a scripted model."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import ray

from executor.config import RunConfig
from executor.reaper import reap_quietly
from executor.schema import batch_to_wire, rows_to_batch, warm_up
from executor.session import SessionContext, SessionRequest, run_session
from executor.tasks import Task
from harnesses.gateway import Gateway
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from sandboxes.base import HidesPaths, SandboxProvider
from sandboxes.prepared import PreparedWorkspaces

if TYPE_CHECKING:  # test machinery: loaded below only when a run asks for it
    from harnesses.testing.scripted_model import ScriptedModel

log = logging.getLogger(__name__)


def gateway_host(cfg: RunConfig) -> str:
    host = cfg.sandbox.gateway_host
    return ray.util.get_node_ip_address() if host == "node-ip" else host


class SandboxWorker:
    """Thin host around ``run_session``; everything with state lives in the session's objects."""

    def __init__(self, config_json: str, run_dir: str, worker_index: int) -> None:
        self.cfg = RunConfig.model_validate_json(config_json)
        self.run_dir = Path(run_dir)
        self.worker_id = f"w{worker_index}-{os.getpid()}"
        self._ctx: SessionContext | None = None
        self._start_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.cfg.concurrency.sessions_per_worker)
        self._ready_monotonic = time.monotonic()  # this process imported, the actor constructed

    async def _context(self) -> SessionContext:
        async with self._start_lock:
            if self._ctx is not None:
                return self._ctx
            cfg = self.cfg
            scripted: ScriptedModel | None = None
            if cfg.model.provider == "scripted":
                from harnesses.testing.scripted_model import ScriptedModel

                scripted = ScriptedModel(model_names=(cfg.model.name,))
                await scripted.start()
                upstream, key = scripted.base_url, None
            else:
                upstream, key = cfg.model.base_url or "", cfg.model.api_key()
            gateway = Gateway(upstream, key, cfg.gateway)
            await gateway.start(host=gateway_host(cfg), unix_path=_gateway_socket(cfg))
            root = cfg.sandbox.root_dir()
            # A worker that died before us may have left sandboxes (process trees, jobs, tasks): ours to end.
            await asyncio.to_thread(reap_quietly, cfg.sandbox)
            self._ctx = SessionContext(
                config=cfg,
                provider=_provider(cfg, root, gateway, self.run_dir),
                harness=make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command),
                gateway=gateway,
                scripted=scripted,
                evidence_root=self.run_dir / "evidence",
                cache_root=default_cache_root(),
                node_id=ray.get_runtime_context().get_node_id(),
                worker_id=self.worker_id,
                workspaces=PreparedWorkspaces(root, cfg.run_id or ""),
            )
            warm_up()
            # Ray's, pyarrow's and pydantic's objects live as long as the worker: out of the collector's
            # reach, a full collection no longer walks them (a ~50 ms stop of this loop, and of every
            # session's model traffic through the gateway, every ~20 rollouts).
            gc.freeze()
            return self._ctx

    async def run(self, task_json: str, sample_index: int, attempt: int) -> bytes:
        """The session's row, as ``executor.schema.batch_to_wire`` sends it."""
        ctx = await self._context()
        req = SessionRequest(
            self.cfg.run_id or "", Task.model_validate_json(task_json), sample_index, attempt
        )
        async with self._slots:
            row = await run_session(req, ctx)
        return batch_to_wire(rows_to_batch([row]))

    @property
    def provider(self) -> SandboxProvider | None:
        """The provider this worker's sessions run on; None until the first session has set it up."""
        return self._ctx.provider if self._ctx is not None else None

    async def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "worker_id": self.worker_id, "ready_monotonic": self._ready_monotonic}

    async def close(self) -> None:
        """End what this worker holds, before its process goes with the cluster: the spare sandbox
        server, the deletions of stopped sandboxes' directories, the prepared workspaces, the gateway
        and the scripted model. Only called once no session runs; idempotent."""
        async with self._start_lock:  # a context being built finishes first, then is closed
            ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        closers = [getattr(ctx.provider, "aclose", None), ctx.gateway.stop]
        if ctx.workspaces is not None:
            closers.append(ctx.workspaces.aclose)
        if ctx.scripted is not None:
            closers.append(ctx.scripted.stop)
        for close in closers:
            if close is None:
                continue
            try:
                await close()
            except Exception as exc:  # one failing part must not keep the others open
                log.warning("closing %s failed: %s", getattr(close, "__qualname__", close), str(exc)[:500])


def _gateway_socket(cfg: RunConfig) -> str | None:
    """A Unix socket for the gateway when sandboxes run in network namespaces of their own; short,
    since a socket path must fit in 108 bytes."""
    if not cfg.sandbox.needs_gateway_socket:
        return None
    return os.path.join(tempfile.gettempdir(), f"rollout-gw-{os.getpid()}-{secrets.token_hex(4)}.sock")


def _provider(cfg: RunConfig, root: Path, gateway: Gateway, run_dir: Path) -> SandboxProvider:
    forward = (urlsplit(gateway.url).port or 0, gateway.unix_path) if gateway.unix_path else None
    provider: SandboxProvider = cfg.sandbox.build(root, forward)
    if isinstance(provider, HidesPaths):  # a sandbox that sees the host must not see the run's directory
        provider.hide(run_dir)
    if cfg.sandbox.inject_start_failures:
        from sandboxes.testing.faults import FlakyStartProvider

        provider = FlakyStartProvider(provider, cfg.sandbox.inject_start_failures)
    return provider


RemoteSandboxWorker = ray.remote(SandboxWorker)
