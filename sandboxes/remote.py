"""The client side of the in-sandbox agent: a ``Sandbox`` whose commands and files go over HTTP.

A provider (Slurm, ECS) starts the agent somewhere and hands this class the address, the token and a
``Teardown`` that knows how to end the job or task; session code cannot tell the result from a local
sandbox. Transport failures become ``SandboxLostError`` once the provider's ``probe`` confirms the
sandbox is gone (or cannot say), so a dead node reads as a lost sandbox, never as a command's failure.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import logging
import math
import os
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from sandboxes.base import (
    TAIL_BYTES,
    ExecResult,
    SandboxError,
    SandboxLostError,
    SandboxSpec,
    SandboxStartError,
)
from sandboxes.environment import base_environment, merge_environment, xdg_dirs

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

AGENT_PATH = Path(__file__).with_name("agent.py")
SUPERVISOR_PATH = Path(__file__).with_name("supervisor.py")
# What those two import of ours: the agent's commands, the /proc helpers and how a supervisor starts its
# command, the agent's layers, and what a command's init uses to make them (its filesystem view, its
# network namespace's relay).
AGENT_IMPORTS = (
    "agent_commands.py",
    "proctree.py",
    "spawn.py",
    "agent_layers.py",
    "fsview.py",
    "netns.py",
    "seccomp.py",
    "isolation.py",
    "uidpool.py",
    "agent_supervisors.py",
    "supervisor_server.py",
    "folded.py",
    "namespaces.py",
    "native_init.py",
    "pidlimit.py",
    "nest.py",
)
# What an exec may take past its own timeout before we stop waiting for the agent's answer: the
# supervisor's kill rounds and drain, and the agent's own slack.
EXEC_SLACK_S = 60.0
REQUEST_TIMEOUT_S = 60.0
COPY_IN_LIMIT_BYTES = 256 * 1024 * 1024
STOP_TIMEOUT_S = 15.0

Probe = Callable[[], Awaitable[str | None]]  # why the sandbox is gone, or None if it seems alive


class Teardown(Protocol):
    """How a provider ends what it started (job, task); idempotent and bounded."""

    async def __call__(self) -> None: ...


_Sandbox = TypeVar("_Sandbox", bound="RemoteSandbox")


async def ready_or_torn_down(
    build: Callable[[], Awaitable[_Sandbox]], teardown: Callable[[], Awaitable[None]], what: str
) -> _Sandbox:
    """The sandbox ``build`` makes once its agent answers; on any failure (or cancellation) on the way,
    what was started is torn down first, and an error that is no SandboxStartError becomes one that
    names ``what``."""
    try:
        sandbox = await build()
        await sandbox.health()
        return sandbox
    except BaseException as exc:
        await asyncio.shield(teardown())
        if isinstance(exc, SandboxStartError) or not isinstance(exc, Exception):
            raise
        raise SandboxStartError(f"{what}: agent not ready: {exc}") from exc


class RemoteSandbox:
    """A started remote sandbox. Build it through a provider; ``descriptor()`` names what to reap."""

    check_runs: Callable[[str, str], Awaitable[None]] | None = None  # a container's checks (container.py)
    python_argv: list[str] | None = None  # a container's interpreter (container.py)
    shares_host_userland = True  # a Slurm or ECS node runs our install; a container says otherwise

    def __init__(
        self,
        *,
        sandbox_id: str,
        provider_name: str,
        spec: SandboxSpec,
        base_url: str,
        token: str,
        root: str,
        teardown: Teardown,
        probe: Probe,
        marker_token: str,
        extra: dict[str, Any] | None = None,
        path_prefixes: tuple[str, ...] = (),
        uds: str | None = None,  # the agent's Unix socket, where it listens on one
    ) -> None:
        self.id = sandbox_id
        self.provider_name = provider_name
        self.spec = spec
        self.root = root.rstrip("/")
        self.workdir = f"{self.root}/work"
        self.home = f"{self.root}/home"
        self.tmpdir = f"{self.root}/tmp"
        self.base_url = base_url
        self._token = token
        self._teardown = teardown
        self._probe = probe
        self._extra = dict(extra or {})
        base = base_environment(
            home=self.home, tmpdir=self.tmpdir, marker_token=marker_token, path_prefixes=path_prefixes
        )
        self.xdg_dirs = xdg_dirs(base)
        self.base_env = merge_environment(base, spec.env)
        self.created_at = time.time()
        self.ttl_deadline = self.created_at + spec.ttl_s
        import httpx  # here: a driver imports the provider configs only

        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=REQUEST_TIMEOUT_S,
            trust_env=False,  # never through a proxy the worker's environment names
            transport=agent_transport(base_url, uds),
        )
        self._stopped = False
        self._stop_lock = asyncio.Lock()
        # The layers the agent's commands run under, as its /health says (agent_layers.py); None until it
        # has answered (an agent of an older version does not say).
        self.isolation_label: str | None = None
        self._gateway: tuple[int | str, ...] | None = None

    def gateway_url(self, url: str, other_port: int | None = None) -> str:
        """The gateway's ``url`` as this sandbox's commands reach it: where they run in a network
        namespace of their own, at 127.0.0.1 on the same port, which the agent relays to ``url``'s host
        (the only address it dials for them); a connection that the harness's process did not open, to
        ``other_port`` there, where the gateway refuses its model calls (sandboxes/netns.py)."""
        if "network" not in (self.isolation_label or "").split(","):
            return url
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise SandboxError(f"sandbox {self.id}: gateway URL {url!r} has no host and port")
        self._gateway = (parts.hostname, parts.port, *([other_port] if other_port else []))
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port}"))

    def descriptor(self) -> dict[str, Any]:
        return {
            "provider": self.provider_name,
            "id": self.id,
            "run_id": self.spec.run_id,
            "session_id": self.spec.session_id,
            "root": self.root,
            "workdir": self.workdir,
            "home": self.home,
            "address": self.base_url,
            "created_at": self.created_at,
            "ttl_deadline": self.ttl_deadline,
            **self._extra,
        }

    # -- transport --------------------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, *, timeout: float | None = None, **kw: Any
    ) -> httpx.Response:
        import httpx

        if self._stopped:
            raise SandboxError(f"sandbox {self.id} is stopped")
        try:
            resp = await self._client.request(method, path, timeout=timeout or REQUEST_TIMEOUT_S, **kw)
        except httpx.TransportError as exc:
            why = await self._why_gone()
            raise SandboxLostError(
                f"sandbox {self.id}: agent unreachable ({type(exc).__name__}: {str(exc)[:300]})"
                + (f"; {why}" if why else "")
            ) from exc
        if resp.status_code == 410:  # the agent's own word that the sandbox is going away
            raise SandboxLostError(f"sandbox {self.id}: {_error_text(resp)}")
        if resp.status_code >= 400 and resp.status_code != 404:
            raise SandboxError(
                f"sandbox {self.id}: {method} {path} -> {resp.status_code}: {_error_text(resp)}"
            )
        return resp

    async def _why_gone(self) -> str | None:
        try:
            return await asyncio.wait_for(self._probe(), timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            return f"probe failed: {type(exc).__name__}: {str(exc)[:200]}"

    async def health(self) -> dict[str, Any]:
        resp = await self._request("GET", "/health", timeout=5.0)
        answer = resp.json()
        self.isolation_label = answer.get("isolation")
        if answer.get("missing"):
            _warn_missing(self.provider_name, "; ".join(map(str, answer["missing"]))[:1000])
        return answer

    # -- the Sandbox protocol ---------------------------------------------------------------------------

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        name: str = "exec",
    ) -> ExecResult:
        if time.time() >= self.ttl_deadline:
            raise SandboxError(f"sandbox {self.id} is past its TTL")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError(f"argv must be a non-empty list of strings, not {argv!r}")
        if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
            raise SandboxError(f"invalid timeout {timeout!r}")
        body = {
            "argv": argv,
            "cwd": cwd or self.workdir,
            "env": merge_environment(self.base_env, env),
            "timeout": float(timeout),
            "name": name,
            "stdin_b64": base64.b64encode(stdin).decode() if stdin is not None else None,
            "memory_limit_mb": self.spec.memory_limit_mb,
        }
        if self._gateway is not None:
            body["gateway"] = list(self._gateway)
        resp = await self._request("POST", "/exec", json=body, timeout=timeout + EXEC_SLACK_S)
        if resp.status_code == 404:
            raise SandboxError(f"sandbox {self.id}: exec: {_error_text(resp)}")
        res = resp.json()
        return ExecResult(
            exit_code=res["exit_code"],
            signal=res.get("signal"),
            timed_out=bool(res.get("timed_out")),
            duration_s=float(res.get("duration_s", 0.0)),
            stdout_path=res.get("stdout_path"),
            stderr_path=res.get("stderr_path"),
            stdout_tail=_tail(res.get("stdout_tail_b64", "")),
            stderr_tail=_tail(res.get("stderr_tail_b64", "")),
            stdout_bytes=int(res.get("stdout_bytes", 0)),
            stderr_bytes=int(res.get("stderr_bytes", 0)),
            oom_kills=int(res.get("oom_kills", 0)),
            limit=str(res["limit"])[:500] if res.get("limit") else None,
        )

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        resp = await self._request(
            "POST", "/upload", params={"path": path, "mode": f"{mode:o}"}, content=data
        )
        if resp.status_code == 404:
            raise SandboxError(f"sandbox {self.id}: upload {path!r}: {_error_text(resp)}")

    async def read_file(self, path: str, limit: int) -> bytes:
        """At most ``limit`` bytes from the start of a regular file. A missing file: FileNotFoundError."""
        if limit < 0:
            raise SandboxError(f"negative read limit {limit}")
        resp = await self._request("GET", "/download", params={"path": path, "limit": str(limit)})
        if resp.status_code == 404:
            raise FileNotFoundError(path)
        return resp.content[:limit]

    async def copy_in(self, src: Path, dest: str | None = None) -> None:
        """Copy a local directory's content into the workspace, or into ``dest`` (a path in the sandbox),
        symlinks kept as links, .git included."""
        src = Path(src)
        if not src.is_dir():
            raise SandboxError(f"cannot copy {src} into sandbox {self.id}: not a directory")
        data = await asyncio.to_thread(_tar_of, src, COPY_IN_LIMIT_BYTES)
        params = {"dest": dest or self.workdir}
        await self._request("POST", "/untar", params=params, content=data, timeout=300.0)

    async def stop(self) -> None:
        """Ask the agent to end its commands, then end the job or task; idempotent, bounded."""
        async with self._stop_lock:
            if self._stopped:
                return
            import httpx

            with contextlib.suppress(httpx.HTTPError):
                await self._client.post("/stop", timeout=STOP_TIMEOUT_S)
            self._stopped = True
            await self._client.aclose()
            await self._teardown()


def agent_transport(base_url: str, uds: str | None = None) -> httpx.AsyncHTTPTransport:
    """How the worker reaches an agent at ``base_url`` (through the Unix socket ``uds``, if given): plain
    HTTP, as every agent serves, so no TLS context and no CA store. httpx loads the system's CAs for
    each transport unless told otherwise, ~20 ms of CPU a sandbox for a context never used. ValueError
    for any other scheme: an agent behind TLS would need a context that verifies it."""
    import httpx

    if urlsplit(base_url).scheme != "http":
        raise ValueError(f"an agent is reached over plain http, not {base_url!r}"[:300])
    return httpx.AsyncHTTPTransport(uds=uds, verify=False)


async def agent_health(base_url: str, token: str, timeout: float = 5.0) -> dict[str, Any]:
    """The agent's /health answer (its root among it); raises httpx errors or SandboxError."""
    import httpx

    transport = agent_transport(base_url)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout, transport=transport) as client:
        resp = await client.get(f"{base_url}/health", headers={"Authorization": f"Bearer {token}"})
    if resp.status_code != 200:
        raise SandboxError(f"agent at {base_url}: /health -> {resp.status_code}: {_error_text(resp)}")
    return resp.json()


def _error_text(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("error", ""))[:2000]
    except ValueError:
        return resp.text[:2000]


def _tail(b64: str) -> str:
    return base64.b64decode(b64)[-TAIL_BYTES:].decode("utf-8", errors="replace")


def _tar_of(src: Path, limit: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as tar:
        for entry in sorted(os.listdir(src)):
            tar.add(src / entry, arcname=entry, recursive=True)
            if buf.tell() > limit:
                raise SandboxError(f"{src} is larger than the copy-in limit of {limit} bytes")
    return buf.getvalue()


def agent_files() -> list[Path]:
    """The files a sandbox needs to run the agent: the agent, the supervisor it runs commands under, and
    what both import."""
    return [AGENT_PATH, SUPERVISOR_PATH, *(AGENT_PATH.with_name(name) for name in AGENT_IMPORTS)]


@functools.cache
def _warn_missing(provider: str, missing: str) -> None:
    log.warning("sandbox %s: the agent's commands run without %s", provider, missing)
