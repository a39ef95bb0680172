"""SandboxWorker: an async Ray actor hosting many sessions, one gateway and (for demos) a scripted model."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import ray

from executor.config import RunConfig
from executor.placement import snapshot
from executor.priority import take_normal_priority
from executor.reaper import GATEWAY_SOCKET_PREFIX, new_evidence_scratch, reap_quietly
from executor.schema import batch_to_wire, refuse_pandas, rows_to_batch, warm_up
from executor.session import SessionContext, SessionRequest, run_session
from executor.storage import Location, locate
from executor.tasks import Task
from harnesses.gateway.upstreams import MAX_VERSIONS_KEPT
from harnesses.install import default_cache_root
from harnesses.registry import make_harness
from sandboxes.base import HidesPaths, SandboxProvider
from sandboxes.inline import inline_if
from sandboxes.prepared import PreparedWorkspaces

# Both imported where a context is built (the scripted model, test machinery, only when a run asks for
# it): a driver imports this module for its actor class and builds none.
if TYPE_CHECKING:
    from harnesses.gateway import Gateway
    from harnesses.testing.scripted_model import ScriptedModel

log = logging.getLogger(__name__)


def gateway_host(cfg: RunConfig) -> str:
    host = cfg.sandbox.gateway_host
    return ray.util.get_node_ip_address() if host == "node-ip" else host


class SandboxWorker:
    """Thin host around ``run_session``; everything with state lives in the session's objects."""

    def __init__(self, config_json: str, run_dir: str, worker_index: int) -> None:
        refuse_pandas()  # the actor's process is its own: pyarrow's first conversion, 0.2 s lighter
        take_normal_priority()  # not Ray's worker niceness: its steps are on its sessions' paths
        self._bind(config_json, run_dir)
        self.worker_id = f"w{worker_index}-{os.getpid()}"
        self._ctx: SessionContext | None = None
        self._start_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.cfg.concurrency.sessions_per_worker)
        self._ready_monotonic = time.monotonic()  # this process imported, the actor constructed
        # Sessions running per context, so that a context a new run replaced is closed once they end.
        self._running: dict[int, int] = {}
        self._idle = asyncio.Condition()
        self._retiring: set[asyncio.Task[None]] = set()
        # The running sessions' rows as they fill, whatever context they run in (executor/placement.py).
        self._live: dict[str, tuple[Any, dict[str, float]]] = {}
        # The trainer's policy versions seen, oldest first (executor/api.py), for a gateway built later.
        self._announced: dict[int, tuple[list[str] | None, str | None]] = {}

    def _bind(self, config_json: str, run_dir: str) -> None:
        self._binding = (config_json, run_dir)
        self.cfg = RunConfig.model_validate_json(config_json)
        self.run_dir = locate(run_dir)

    def _run_parts(self) -> dict[str, Any]:
        """The parts of a session context that are the run's own: its config, where its evidence is
        written (and put after: a run on an object store writes to this node's scratch first), and its
        prepared workspaces."""
        cfg = self.cfg
        if self.run_dir.local is not None:
            evidence_root, evidence_store = self.run_dir.local / "evidence", None
        else:
            evidence_root = new_evidence_scratch(cfg.run_id or "")
            evidence_store = self.run_dir / "evidence"
        return {
            "config": cfg,
            "evidence_root": evidence_root,
            "evidence_store": evidence_store,
            "workspaces": PreparedWorkspaces(cfg.sandbox.root_dir(), cfg.run_id or ""),
        }

    async def _context(self) -> SessionContext:
        async with self._start_lock:
            if self._ctx is not None:
                return self._ctx
            from harnesses.gateway import Gateway
            from harnesses.gateway.upstreams import Upstreams

            cfg = self.cfg
            scripted: ScriptedModel | None = None
            upstream: str | list[str]
            if cfg.model.provider == "scripted":
                from harnesses.testing.scripted_model import ScriptedModel

                scripted = ScriptedModel(model_names=(cfg.model.name,))
                await scripted.start()
                upstream, key = scripted.base_url, None
            else:
                upstream, key = cfg.model.base_urls, cfg.model.api_key()
            upstreams = Upstreams(
                [upstream] if isinstance(upstream, str) else upstream,
                cfg.model.name,
                affinity_header=cfg.model.affinity_header,
                failures_to_eject=cfg.model.replica_failures,
                cooldown_s=cfg.model.replica_cooldown_s,
            )
            for version, (urls, model) in self._announced.items():
                upstreams.announce(version, urls, model)
            gateway = Gateway(upstreams, key, cfg.gateway, **cfg.model.pins())
            await gateway.start(host=gateway_host(cfg), unix_path=gateway_socket(cfg))
            root = cfg.sandbox.root_dir()
            # A worker that died before us may have left sandboxes (process trees, jobs, tasks): ours to end.
            await asyncio.to_thread(reap_quietly, cfg.sandbox)
            self._ctx = SessionContext(
                provider=build_provider(cfg, root, gateway, self.run_dir),
                harness=make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command),
                gateway=gateway,
                scripted=scripted,
                cache_root=default_cache_root(),
                node_id=ray.get_runtime_context().get_node_id(),
                worker_id=self.worker_id,
                live=self._live,
                **self._run_parts(),
            )
            warm_up()
            # Ray's, pyarrow's and pydantic's objects live as long as the worker: out of the collector's
            # reach, a full collection no longer walks them (a ~50 ms stop of this loop, and of every
            # session's model traffic through the gateway, every ~20 rollouts).
            gc.freeze()
            return self._ctx

    async def run(
        self,
        task_json: str,
        sample_index: int,
        attempt: int,
        binding: tuple[str, str] | None = None,
        policy: str | None = None,
    ) -> bytes:
        """The session's row, as ``executor.schema.batch_to_wire`` sends it. ``binding``, the run's
        (config JSON, run directory), comes with every session of a warm worker (executor/warm.py): the
        worker serves run after run, and Ray restarts a crashed one with the first run's arguments.
        ``policy``: the trainer's policy version the session starts under (``announce``'s JSON)."""
        if binding is not None and tuple(binding) != self._binding:
            await self._rebind(*binding)
        version = await self.announce(policy) if policy is not None else None
        ctx = await self._context()
        req = SessionRequest(
            ctx.config.run_id or "", Task.model_validate_json(task_json), sample_index, attempt, version
        )
        key = id(ctx)
        self._running[key] = self._running.get(key, 0) + 1
        try:
            async with self._slots:
                row = await run_session(req, ctx)
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
                async with self._idle:
                    self._idle.notify_all()
        # Captured token ids (a million a session is ordinary) take tenths of a second to convert: in a
        # thread, not on the loop that serves every other session's model requests.
        return await inline_if(not _captures_tokens(row), _to_wire, row)

    async def _rebind(self, config_json: str, run_dir: str) -> None:
        """Serve another run: what the worker built once (gateway, scripted model, provider, harness) is
        kept where the new config builds the same; the run's own parts are new. Sessions of the run
        before (a driver that died) finish on the context they started with, which is closed after."""
        async with self._start_lock:
            if (config_json, run_dir) == self._binding:
                return
            old_cfg, old = self.cfg, self._ctx
            self._bind(config_json, run_dir)
            # A gateway that followed a trainer's policy versions is that run's: the next run starts anew.
            versioned, self._announced = bool(self._announced), {}
            if old is None:
                return
            cfg = self.cfg
            if built_once(cfg) == built_once(old_cfg) and not versioned:
                _hide_run(old.provider, self.run_dir)
                self._ctx = dataclasses.replace(old, **self._run_parts())
                closers = _run_closers(old)
            else:
                self._ctx = None
                self._slots = asyncio.Semaphore(cfg.concurrency.sessions_per_worker)
                closers = _closers(old)
        task = asyncio.create_task(self._retire(id(old), closers))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, key: int, closers: list[Callable[[], Awaitable[None]]]) -> None:
        async with self._idle:
            await self._idle.wait_for(lambda: key not in self._running)
        await _close_all(closers)

    async def announce(self, policy: str) -> int:
        """A trainer's policy version: ``{"version": N, "base_urls": [...] | null, "model": ... | null}``
        (null: as the version before). Sessions the driver sends under it use its endpoint; calls of
        sessions already running at the same endpoint are answered by it from now on. Idempotent."""
        data = json.loads(policy)
        version, urls, model = int(data["version"]), data.get("base_urls"), data.get("model")
        if version not in self._announced:
            self._announced[version] = (urls, model)
            while len(self._announced) > MAX_VERSIONS_KEPT:
                del self._announced[next(iter(self._announced))]
        if self._ctx is not None:
            self._ctx.gateway.upstreams.announce(version, urls, model)
        return version

    async def prepare(self) -> str:
        """Build what the sessions share now, not at the first session (``rollout up CONFIG``)."""
        await self._context()
        return self.worker_id

    async def key_matches(self, nonce: bytes, digest: bytes) -> bool:
        """Whether this process sees the run's API key: its HMAC under ``nonce`` is ``digest``. A warm
        worker reads the key from the environment ``rollout up`` ran in, not the run's."""
        return hmac.compare_digest(key_digest(self.cfg.model.api_key_env, nonce), digest)

    async def release(self) -> None:
        """The run is over (no session of it runs): let go of its prepared workspaces, keep the rest."""
        async with self._start_lock:
            ctx = self._ctx
        if ctx is not None:
            await _close_all(_run_closers(ctx))

    @property
    def provider(self) -> SandboxProvider | None:
        """The provider this worker's sessions run on; None until the first session has set it up."""
        return self._ctx.provider if self._ctx is not None else None

    async def sessions(self) -> dict[str, Any]:
        """Where this worker runs and what is known of each session running in it, for the driver to
        write on a row a session never returns (executor/placement.py)."""
        node_id = ray.get_runtime_context().get_node_id()
        return {"node_id": node_id, "worker_id": self.worker_id, "sessions": snapshot(self._live)}

    async def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "worker_id": self.worker_id, "ready_monotonic": self._ready_monotonic}

    async def close(self) -> None:
        """End what this worker holds, before its process goes with the cluster: the spare sandbox
        server, the deletions of stopped sandboxes' directories, the prepared workspaces, the gateway
        and the scripted model. Only called once no session runs; idempotent."""
        async with self._start_lock:  # a context being built finishes first, then is closed
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await _close_all(_closers(ctx))


def key_digest(env_name: str | None, nonce: bytes) -> bytes:
    """The HMAC of the API key this process's environment holds: compared, never the key itself."""
    value = os.environ.get(env_name, "") if env_name else ""
    return hmac.new(nonce, value.encode(), hashlib.sha256).digest()


def _to_wire(row: dict[str, Any]) -> bytes:
    return batch_to_wire(rows_to_batch([row]))


def _captures_tokens(row: dict[str, Any]) -> bool:
    calls = row.get("model_calls") or ()
    return any(call.get("prompt_token_ids") or call.get("completion_token_ids") for call in calls)


def built_once(cfg: RunConfig) -> str:
    """The parts of a config a worker's context is built from (its gateway, model, provider, harness)."""
    return cfg.model_dump_json(include={"model", "gateway", "sandbox", "harness"})


def _run_closers(ctx: SessionContext) -> list[Callable[[], Awaitable[None]]]:
    """What of a context was its run's: its sandboxes' stops and directory removals still under way (a
    stop its session gave up waiting for goes on), the prepared workspaces and, for a run on an object
    store, this node's evidence scratch (normally emptied as each launch's evidence is put)."""
    closers: list[Callable[[], Awaitable[None]]] = []
    if (finish := getattr(ctx.provider, "finish_removals", None)) is not None:
        closers.append(finish)
    if ctx.workspaces is not None:
        closers.append(ctx.workspaces.aclose)
    if ctx.evidence_store is not None:
        closers.append(functools.partial(asyncio.to_thread, shutil.rmtree, ctx.evidence_root, True))
    return closers


def _closers(ctx: SessionContext) -> list[Callable[[], Awaitable[None]]]:
    closers: list[Callable[[], Awaitable[None]] | None] = [
        getattr(ctx.provider, "aclose", None),
        ctx.gateway.stop,
    ]
    if ctx.scripted is not None:
        closers.append(ctx.scripted.stop)
    return [c for c in closers if c is not None] + _run_closers(ctx)


async def _close_all(closers: list[Callable[[], Awaitable[None]]]) -> None:
    for close in closers:
        try:
            await close()
        except Exception as exc:  # one failing part must not keep the others open
            log.warning("closing %s failed: %s", getattr(close, "__qualname__", close), str(exc)[:500])


def gateway_socket(cfg: RunConfig) -> str | None:
    """A Unix socket for the gateway when sandboxes run in network namespaces of their own; short,
    since a socket path must fit in 108 bytes. One a killed worker left is removed by the next reaper on
    this node (``executor.reaper.reap_gateway_sockets``)."""
    if not cfg.sandbox.needs_gateway_socket:
        return None
    return os.path.join(
        tempfile.gettempdir(), f"{GATEWAY_SOCKET_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.sock"
    )


def _hide_run(provider: SandboxProvider, run_dir: Location) -> None:
    """A sandbox that sees the worker's host must not see the run's directory (nor, for a warm worker,
    any run's it served): a run on an object store has none here, its evidence scratch is under the
    hidden /tmp."""
    if isinstance(provider, HidesPaths) and run_dir.local is not None:
        provider.hide(run_dir.local)


def build_provider(cfg: RunConfig, root: Path, gateway: Gateway, run_dir: Location) -> SandboxProvider:
    forward = (urlsplit(gateway.url).port or 0, gateway.unix_path) if gateway.unix_path else None
    provider: SandboxProvider = cfg.sandbox.build(root, forward)
    _hide_run(provider, run_dir)
    if cfg.sandbox.inject_start_failures:
        from sandboxes.testing.faults import FlakyStartProvider

        provider = FlakyStartProvider(provider, cfg.sandbox.inject_start_failures)
    return provider


RemoteSandboxWorker = ray.remote(SandboxWorker)
