"""SandboxWorker: an async Ray actor hosting many sessions, one gateway and (for demos) a scripted model."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from executor.config import RunConfig
from executor.schema import rows_to_batch
from executor.session import SessionContext, SessionRequest, run_session
from executor.tasks import Task
from harnesses.gateway import Gateway
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from harnesses.scripted_model import ScriptedModel
from sandboxes.local import LocalSandboxProvider, reap_stale


def sandbox_root(cfg: RunConfig) -> Path:
    return Path(cfg.sandbox.root) if cfg.sandbox.root else default_cache_root() / "sandboxes"


class SandboxWorker:
    """Thin host around ``run_session``; everything with state lives in the session's objects."""

    def __init__(self, config_json: str, run_dir: str, worker_index: int) -> None:
        self.cfg = RunConfig.model_validate_json(config_json)
        self.run_dir = Path(run_dir)
        self.worker_id = f"w{worker_index}-{os.getpid()}"
        self._ctx: SessionContext | None = None
        self._start_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.cfg.concurrency.sessions_per_worker)

    async def _context(self) -> SessionContext:
        async with self._start_lock:
            if self._ctx is not None:
                return self._ctx
            cfg = self.cfg
            scripted: ScriptedModel | None = None
            if cfg.model.provider == "scripted":
                scripted = ScriptedModel(model_names=(cfg.model.name,))
                await scripted.start()
                upstream, key = scripted.base_url, None
            else:
                upstream, key = cfg.model.base_url or "", cfg.model.api_key()
            gateway = Gateway(upstream, key, cfg.gateway)
            await gateway.start()
            root = sandbox_root(cfg)
            # A worker that died before us may have left sandboxes; its process trees are ours to end.
            await asyncio.to_thread(reap_stale, root, None)
            self._ctx = SessionContext(
                config=cfg,
                provider=LocalSandboxProvider(root, keep=cfg.sandbox.keep),
                harness=make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command),
                gateway=gateway,
                scripted=scripted,
                evidence_root=self.run_dir / "evidence",
                cache_root=default_cache_root(),
                node_id=ray.get_runtime_context().get_node_id(),
                worker_id=self.worker_id,
            )
            return self._ctx

    async def run(self, task_json: str, sample_index: int, attempt: int) -> pa.RecordBatch:
        ctx = await self._context()
        req = SessionRequest(
            self.cfg.run_id or "", Task.model_validate_json(task_json), sample_index, attempt
        )
        async with self._slots:
            row = await run_session(req, ctx)
        return rows_to_batch([row])

    async def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "worker_id": self.worker_id}


RemoteSandboxWorker = ray.remote(SandboxWorker)
