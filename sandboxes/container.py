"""The ``container`` sandbox: one container per session, from the task's image (or the run's), through
podman or docker on the worker's machine.

The container runs the in-sandbox agent (sandboxes/agent.py) under the image's own python3, from files
mounted read-only; every command runs under the supervisor there (deadline, tree kill, capped output,
exit status and signals passed through), as on Slurm and ECS. The worker reaches the agent through a Unix
socket in the session's directory, bind-mounted at ``/rollout``::

    <root>/<run_id>/<session_id>/      -> /rollout in the container
        work/ home/ tmp/ logs/ run/       the agent's tree; work/ is the workspace unless the image
                                          sets a WORKDIR (then that is)
        control/                          token (0600), agent.sock, ready.json

The container has no network (``--network none``) but its loopback, where 127.0.0.1:PORT is relayed to
the gateway's Unix socket, mounted in (sandboxes/netns.py's forwarder): the gateway is all it reaches,
with a per-session token; the API key never enters. The harness install cache is mounted read-only at
its own path, so a harness's argv is the same inside as outside.

Labels carry the run id, the owner (host, boot, pid, start ticks, its record under the root) and the TTL
deadline: ``reap`` removes what a dead owner left (proven by its record's lock, sandboxes/owner.py) and
whatever outlived its TTL. The agent itself exits at the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import resource
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sandboxes import netns
from sandboxes.base import (
    SandboxError,
    SandboxSpec,
    SandboxStartError,
    TaskEnvironmentError,
    check_session_names,
)
from sandboxes.cache_root import default_cache_root
from sandboxes.images import ImageInfo, Images
from sandboxes.owner import Owner, hold
from sandboxes.provider_config import NetworkForward, ProviderConfig
from sandboxes.remote import RemoteSandbox, agent_files, ready_or_torn_down
from sandboxes.runtime import RT_IN, Runtime, RuntimeUnavailable, host_runtime

log = logging.getLogger(__name__)

LABEL = "rollout.sandbox"
CODE_DIR = "/opt/rollout"  # the agent's files, read-only
ROOT_IN = "/rollout"  # the session's directory
GATEWAY_SOCKET_IN = "/run/rollout-gateway.sock"
ENTRY_PATH = Path(__file__).with_name("container_entry.py")
COMMAND_TIMEOUT_S = 60.0
# Containers started ahead, for the next sandboxes like the last one (an agent's and its grading one):
# podman's run and the agent's start (0.3-0.6 s) are then off a session's path. A spare idle longer than
# SPARE_IDLE_S is removed rather than used.
SPARES = 2
SPARE_IDLE_S = 60.0
REMOVE_TIMEOUT_S = 60.0
REMOVE_ATTEMPTS = 3
POLL_S = 0.02
STATE_EVERY_S = 1.0
# Installed-harness trees under the cache; the rest of it (other sessions' directories) stays out.
_CACHE_SKIP = {"sandboxes", "images"}
_LINK_DIR = Path("/tmp/rollout-ctr")


class ContainerSandboxConfig(ProviderConfig):
    provider: Literal["container"] = "container"
    engine: Literal["podman", "docker"] = "podman"
    image: str | None = None  # the run's default image; a task's own image or build wins
    # The python that runs the agent and the supervisor: None (the default) carries the worker's own in,
    # with its loader and libraries (sandboxes/runtime.py), so the image needs none; a name or path is
    # the image's own (>= 3.11).
    python: str | None = None
    # The OCI runtime (podman --runtime): "runc" where crun refuses (cgroups in hybrid mode).
    runtime: str | None = None
    # Passed to run as --ulimit each: where raising limits is not allowed (no CAP_SYS_RESOURCE), the
    # engine's defaults fail, and explicit ones at or under the host's hard limits are needed.
    ulimits: list[str] = Field(default_factory=list)
    run_args: list[str] = Field(default_factory=list)  # anything else for run (e.g. --security-opt)
    cpus: float | None = Field(default=None, gt=0)  # per container, unless the task sets its own
    memory_mb: int | None = Field(default=None, gt=0)
    start_timeout_s: float = Field(default=120.0, gt=0)
    build_timeout_s: float = Field(default=1800.0, gt=0)  # a task's own bound wins
    # A task's storage_mb as --storage-opt size=: only overlay on xfs with pquota can enforce it, so off
    # by default (a task's quota is then not enforced, and the worker says so once).
    storage_limits: bool = False

    @property
    def needs_gateway_socket(self) -> bool:
        return True

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> ContainerSandboxProvider:
        if network_forward is None:
            raise ValueError("sandbox.provider 'container' needs the gateway's port and Unix socket")
        return ContainerSandboxProvider(root, self, network_forward)

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        return reap_containers(self.engine, root, run_id, everything=everything)


def _engine(
    engine: str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [engine, *argv], capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd
        )
    except FileNotFoundError:
        # Checked here, on the worker's machine: the driver's (a cluster's head) may have no engine.
        raise SandboxError(f"sandbox.engine {engine!r} is not installed on this machine") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"{engine} {argv[0]}: {exc}") from exc


def _one_line(text: str, limit: int = 600) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-limit:] or "(no output)"


def _owner_label(owner: Owner) -> str:
    return " ".join(f"{k}={v}" for k, v in owner.encode().items())


def _parse_owner_label(value: str) -> Owner | None:
    return Owner.decode(dict(part.split("=", 1) for part in value.split() if "=" in part))


def list_containers(engine: str, run_id: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every rollout container, running or not, of one run if ``run_id`` is given."""
    argv = ["ps", "-a", "-q", "--no-trunc", "--filter", f"label={LABEL}=1"]
    if run_id is not None:
        argv += ["--filter", f"label=rollout.run_id={run_id}"]
    proc = _engine(engine, argv)
    if proc.returncode != 0:
        raise SandboxError(f"{engine} ps failed: {_one_line(proc.stderr)}")
    ids = proc.stdout.split()
    if not ids:
        return []
    proc = _engine(engine, ["inspect", "--format", "{{.Name}} {{json .Config.Labels}}", *ids])
    found = []
    for line in proc.stdout.splitlines():  # a container removed meanwhile is missing here: fine
        name, _, labels = line.partition(" ")
        with contextlib.suppress(ValueError):
            found.append((name.lstrip("/"), {str(k): str(v) for k, v in (json.loads(labels) or {}).items()}))
    return found


def _rm(engine: str, container: str) -> list[str]:
    # No stop timeout: the agent has been told to stop (its commands' trees are ended) or its owner is
    # dead, and nothing in the container is owed a grace. podman's default (10 s), or any grace, is
    # paid in full by a PID 1 that ignores SIGTERM (1.2 s of `rm -f -t 1` against 0.2 s of `-t 0`).
    # docker rm -f kills at once.
    return ["rm", "-f", "-t", "0", container] if engine == "podman" else ["rm", "-f", container]


def remove(engine: str, container: str) -> bool:
    """Remove the container, running or not; True once it is gone. Tried a few times: an engine busy with
    other containers' removals can refuse one for a moment."""
    for attempt in range(REMOVE_ATTEMPTS):
        proc = _engine(engine, _rm(engine, container), REMOVE_TIMEOUT_S)
        if proc.returncode == 0 or _engine(engine, ["inspect", "--format", "{{.Id}}", container]).returncode:
            return True
        log.info(
            "%s rm of %s failed (attempt %d): %s", engine, container, attempt + 1, _one_line(proc.stderr)
        )
        time.sleep(0.2 * (attempt + 1))
    return False


def reap_containers(
    engine: str, root: Path, run_id: str | None = None, *, everything: bool = False, now: float | None = None
) -> list[str]:
    """Remove the rollout containers whose owner this host proves dead by its record under ``root``, or
    whose TTL passed; with ``everything``, every one of ``run_id``. Containers of another sandbox root are
    left to their TTL. Returns the names of the containers removed; idempotent."""
    if everything and run_id is None:
        raise ValueError("reaping everything needs a run id")
    if shutil.which(engine) is None:
        return []  # nothing can have been started here through it
    now = time.time() if now is None else now
    root = Path(root).resolve()
    reaped = []
    for name, labels in list_containers(engine, run_id):
        owner = _parse_owner_label(labels.get("rollout.owner", ""))
        ttl = labels.get("rollout.ttl", "")
        expired = ttl.isdigit() and now > int(ttl)
        ours = labels.get("rollout.root") == str(root)
        if everything or expired or (ours and owner is not None and owner.known_dead(root)):
            if remove(engine, name):
                reaped.append(name)
                _forget_socket_link(name)
                session_dir = Path(labels.get("rollout.dir", ""))
                if ours and session_dir.is_relative_to(root) and session_dir != root:
                    shutil.rmtree(session_dir, ignore_errors=True)
            else:
                log.warning("container %s survived %s rm -f", name, engine)
    return reaped


class ContainerSandbox(RemoteSandbox):
    """A RemoteSandbox whose relative paths are the workspace's, which may be the image's WORKDIR."""

    shares_host_userland = False  # harnesses run their own binaries, not the worker's node or python

    def __init__(
        self,
        *,
        workdir: str | None,
        image: str,
        runs: set[tuple[str, str]],
        python_argv: list[str],
        session_dir: Path,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        # Where the workspace is on the worker's host, for a carry between sandboxes done there
        # (executor/grading.py): the session's directory is bind-mounted at /rollout, so a workspace at
        # /rollout/work is its work/. Only as root, as the container's root is (rootful podman, docker):
        # its commands' files are then the worker's to read, and the worker's its to use; and only
        # where commands run as root (no image user to own what the worker writes).
        self.host_workdir: Path | None = None
        if workdir:
            self.workdir = workdir
        elif os.geteuid() == 0 and self.spec.user in (None, "", "root", "0"):
            self.host_workdir = session_dir / "work"
        self.image = image
        # A python >= 3.11 in this container for our own helper scripts, whatever the image holds.
        self.python_argv = python_argv
        self._runs = runs  # (image, program) pairs seen to run, shared by the provider's sandboxes

    async def check_runs(self, program: str, what: str) -> None:
        """SandboxError, one line naming the image and what is missing, unless ``program`` starts here
        (a harness's binary, or the runtime it needs: node, python). Once per image and program."""
        if (self.image, program) in self._runs:
            return
        res = await self.exec([program, "--version"], timeout=60, name="check-runs")
        # 126/127: not found, not executable, or its loader or a shared library missing.
        if res.exit_code in (126, 127) or res.signal is not None:
            said = " ".join((res.stderr_tail or res.stdout_tail).split())[-300:] or f"exit {res.exit_code}"
            raise SandboxError(f"image {self.image!r} cannot run {what}: {program}: {said}")
        self._runs.add((self.image, program))

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await super().write_file(self._path(path), data, mode)

    async def read_file(self, path: str, limit: int) -> bytes:
        return await super().read_file(self._path(path), limit)


@dataclass(frozen=True)
class _Launch:
    """A container of ours, before or after its run: its name, directory, owner record, agent token."""

    name: str
    session_dir: Path
    owner_name: str
    token: str
    socket_path: str
    made: float  # monotonic


def _spare_key(spec: SandboxSpec, image: ImageInfo) -> str:
    """What of a spec a container is made with (its run argv, its agent's TTL): a spare made for one
    spec serves another only where all of it is the same."""
    fields = ("run_id", "allow_internet", "cpus", "memory_limit_mb", "storage_mb", "gpus", "workdir", "user")
    return json.dumps([image.ref, spec.ttl_s, *(getattr(spec, f) for f in fields)], default=str)


class ContainerSandboxProvider:
    isolation_label: str | None = None  # each sandbox's agent says (RemoteSandbox)

    def __init__(self, root: Path, config: ContainerSandboxConfig, network_forward: NetworkForward) -> None:
        self.root = Path(root).resolve()
        self.cfg = config
        self.name = "container"
        self.engine = config.engine
        self.port, self.gateway_socket = network_forward
        self.cache_root = default_cache_root().resolve()
        runtime = ["--runtime", config.runtime] if config.runtime and config.engine == "podman" else []
        self._runs: set[tuple[str, str]] = set()
        # Removals of stopped sandboxes' containers, under way off their sessions' path (_teardown).
        self._removals: set[asyncio.Task[None]] = set()
        # Spare containers, oldest first: their loop, their key (_spare_key), their start.
        self._spares: list[tuple[asyncio.AbstractEventLoop, str, asyncio.Future[_Launch]]] = []
        self._closing = False
        # The run is over (finish_removals) and no sandbox has started since: a stop still under way then
        # (one its session gave up waiting for) starts no spare, which no one would take or remove.
        self._over = False
        # The --ulimit sets to try when the config names none, the first one known to work or untried.
        self._ulimits = _ulimit_choices()
        self.images = Images(
            config.engine,
            self.cache_root / "images",
            build_args=runtime,
            build_timeout_s=config.build_timeout_s,
        )

    def _harness_mounts(self) -> list[str]:
        paths: list[Path] = []
        with contextlib.suppress(OSError):
            for entry in sorted(os.scandir(self.cache_root), key=lambda e: e.name):
                path = Path(entry.path)
                if entry.name in _CACHE_SKIP or not entry.is_dir() or self.root.is_relative_to(path):
                    continue
                paths.append(path)
        paths += _venv_interpreters(self.cache_root / "venv")
        return [arg for path in paths for arg in ("-v", f"{path}:{path}:ro")]

    def _run_argv(
        self,
        spec: SandboxSpec,
        image: ImageInfo,
        name: str,
        session_dir: Path,
        owner_name: str,
        runtime: Runtime | None,
    ) -> list[str]:
        cfg = self.cfg
        ttl_deadline = time.time() + spec.ttl_s
        labels = {
            LABEL: "1",
            "rollout.run_id": spec.run_id,
            "rollout.session_id": spec.session_id,
            "rollout.owner": _owner_label(Owner.current(owner_name)),
            "rollout.ttl": str(int(ttl_deadline) + 1),
            "rollout.root": str(self.root),
            "rollout.dir": str(session_dir),
        }
        # No network but the loopback (where the gateway is relayed), unless the task allows the internet:
        # then the engine's default network too. The gateway is reached the same way in both.
        network = "bridge" if spec.allow_internet else "none"
        argv = ["run", "-d", "--name", name, "--network", network, "--pull", "never"]
        # A nested root command's user namespace does not own the container's network one (nest.py): the
        # ports below 1024 are its to bind only so.
        argv += ["--sysctl", "net.ipv4.ip_unprivileged_port_start=0"]
        if cfg.runtime and cfg.engine == "podman":
            argv += ["--runtime", cfg.runtime]
        for key, value in labels.items():
            argv += ["--label", f"{key}={value}"]
        for ulimit in cfg.ulimits or self._ulimits[0]:
            argv += ["--ulimit", ulimit]
        cpus = spec.cpus or cfg.cpus
        memory = spec.memory_limit_mb or cfg.memory_mb
        if cpus:
            argv += ["--cpus", f"{cpus:g}"]
        if memory:
            argv += ["--memory", f"{memory}m"]
        if spec.storage_mb and cfg.storage_limits:
            argv += ["--storage-opt", f"size={spec.storage_mb}m"]
        if spec.gpus:
            argv += ["--device", "nvidia.com/gpu=all"]  # CDI: the host's NVIDIA toolkit names them
        if spec.workdir:
            argv += ["--workdir", spec.workdir]  # made by the engine when the image lacks it
        argv += ["-v", f"{session_dir}:{ROOT_IN}", "-v", f"{self.gateway_socket}:{GATEWAY_SOCKET_IN}"]
        other = netns.other_socket(self.gateway_socket)
        if os.path.exists(other):  # where the forwarder relays what the harness's process did not open
            argv += ["-v", f"{other}:{netns.other_socket(GATEWAY_SOCKET_IN)}"]
            # The forwarder (root, the container's first process) finds which process opened a connection
            # by its descriptors, which the kernel shows another user's process only with this capability.
            # The agent's commands get it only if they run as root, who could trace its processes anyway.
            argv += ["--cap-add", "SYS_PTRACE"]
        for src in [*agent_files(), Path(netns.__file__), ENTRY_PATH]:
            argv += ["-v", f"{src}:{CODE_DIR}/{src.name}:ro"]
        argv += self._harness_mounts()
        if runtime is not None:
            argv += runtime.mount_args()
            python, *python_args = runtime.argv
            python_args += ["-E", "-s", "-S"]  # nothing of the image's environment or site steers it
        else:
            python, python_args = cfg.python, []
        argv += [*cfg.run_args, "--entrypoint", python, image.ref, *python_args]
        argv += [
            f"{CODE_DIR}/{ENTRY_PATH.name}",
            "--forward", f"{self.port}:{GATEWAY_SOCKET_IN}",
            "--root", ROOT_IN,
            "--unconfined",
            "--token-file", f"{ROOT_IN}/control/token",
            "--unix-socket", f"{ROOT_IN}/control/agent.sock",
            "--rendezvous", f"{ROOT_IN}/control/ready.json",
            "--ttl-s", f"{spec.ttl_s:.0f}",
        ]  # fmt: skip
        if spec.user and spec.user not in ("root", "0"):
            argv += ["--run-as", spec.user]  # the image's user: the agent, as root, runs commands as it
        else:  # root commands beside the agent: out of its reach, and it out of theirs (nest.py)
            argv += ["--nest", "--hide", f"{ROOT_IN}/control", "--hide", GATEWAY_SOCKET_IN]
            if os.path.exists(other):
                argv += ["--hide", netns.other_socket(GATEWAY_SOCKET_IN)]
        if runtime is not None and runtime.argv[0] != f"{RT_IN}/bin/python3":
            argv += ["--loader", runtime.argv[0], "--library-path", runtime.argv[2]]
        return argv

    def _prepare(self, session_dir: Path) -> str:
        session_dir.parent.mkdir(parents=True, exist_ok=True)
        session_dir.mkdir(mode=0o700)
        (session_dir / "control").mkdir(mode=0o700)
        token = secrets.token_urlsafe(32)
        fd = os.open(session_dir / "control" / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return token

    async def start(self, spec: SandboxSpec) -> ContainerSandbox:
        check_session_names(spec)
        self._over = False
        default = None if spec.build_context else self.cfg.image
        if spec.gpus and not _host_gpus():
            raise TaskEnvironmentError(
                f"the task asks for {spec.gpus} GPU(s) ([environment] gpus); "
                "this host has none (no /dev/nvidia0)"
            )
        if spec.storage_mb and not self.cfg.storage_limits:
            _storage_unenforced(spec.storage_mb)
        image = await self.images.resolve(spec.image or default, spec.build_context, spec.build_timeout_s)
        runtime = None
        if self.cfg.python is None:
            try:
                runtime = await asyncio.to_thread(host_runtime, self.cache_root)
            except (RuntimeUnavailable, OSError) as exc:
                raise SandboxStartError(f"cannot carry the worker's python into a container: {exc}") from exc
        spare = await self._claim(_spare_key(spec, image))
        if spare is not None:
            try:
                return await ready_or_torn_down(
                    functools.partial(self._adopt, spec, image, runtime, spare),
                    functools.partial(self._remove, spare.name, spare.session_dir),
                    f"container {spare.name} ({image.ref})",
                )
            except SandboxStartError as exc:  # gone while it waited: a container of its own, then
                log.info("container: spare %s unusable (%s); starting another", spare.name, exc)
        launch = await self._launch(spec, image, runtime)

        async def build() -> ContainerSandbox:
            await self._run(launch, spec, image, runtime)
            return await self._adopt(spec, image, runtime, launch)

        # A start given up removes what it began before it raises: no row is waiting on it.
        return await ready_or_torn_down(
            build,
            functools.partial(self._remove, launch.name, launch.session_dir),
            f"container {launch.name} ({image.ref})",
        )

    async def _launch(self, spec: SandboxSpec, image: ImageInfo, runtime: Runtime | None) -> _Launch:
        """A container's name, directory and token, before it is run."""
        session_dir = self.root / spec.run_id / spec.session_id
        try:
            owner_name = await asyncio.to_thread(hold, self.root)
            token = await asyncio.to_thread(self._prepare, session_dir)
        except FileExistsError as exc:
            raise SandboxStartError(f"sandbox directory {session_dir} already exists") from exc
        except OSError as exc:
            raise SandboxStartError(f"cannot lay out sandbox directory {session_dir}: {exc}") from exc
        name = f"rollout-{uuid.uuid4().hex[:16]}"
        socket_path = _socket_path(session_dir / "control" / "agent.sock", name)
        return _Launch(name, session_dir, owner_name, token, socket_path, time.monotonic())

    async def _run(
        self, launch: _Launch, spec: SandboxSpec, image: ImageInfo, runtime: Runtime | None
    ) -> None:
        """Run the container and wait for its agent's rendezvous."""
        name, session_dir = launch.name, launch.session_dir
        argv = self._run_argv(spec, image, name, session_dir, launch.owner_name, runtime)
        tried = self._ulimits[0]
        # From the session's directory: the container's monitor (podman's conmon) writes a file named
        # `oom` where it was started when the container's memory cap kills, which is no one's to find in
        # the worker's working directory.
        run = functools.partial(_engine, self.engine, timeout=self.cfg.start_timeout_s, cwd=session_dir)
        proc = await asyncio.to_thread(run, argv)
        # Limits of our choosing the engine cannot apply: the next, lower choice, for this start and
        # every later one (the error names no limit an operator could act on).
        while proc.returncode != 0 and "rlimit" in proc.stderr and not self.cfg.ulimits:
            if len(self._ulimits) == 1:
                break
            log.info("container: %s cannot apply --ulimit %s; trying lower", self.engine, self._ulimits[0])
            await asyncio.to_thread(remove, self.engine, name)
            if self._ulimits[0] is tried:  # a concurrent start may have moved on already
                self._ulimits.pop(0)
            tried = self._ulimits[0]
            argv = self._run_argv(spec, image, name, session_dir, launch.owner_name, runtime)
            proc = await asyncio.to_thread(run, argv)
        if proc.returncode != 0:
            raise SandboxStartError(self._cannot_run(image.ref, proc.stderr))
        await self._wait_ready(name, session_dir / "control")

    async def _adopt(
        self, spec: SandboxSpec, image: ImageInfo, runtime: Runtime | None, launch: _Launch
    ) -> ContainerSandbox:
        """The sandbox of a container whose agent is ready (started for ``spec``, or a spare), as
        ``spec`` says: its TTL, environment and teardown are the session's."""
        name, session_dir = launch.name, launch.session_dir
        workdir = spec.workdir or image.workdir
        return ContainerSandbox(
            workdir=workdir if workdir not in ("", "/") else None,
            image=image.ref,
            runs=self._runs,
            python_argv=[*runtime.argv, "-E", "-s", "-S"] if runtime else [str(self.cfg.python)],
            session_dir=session_dir,
            sandbox_id=name,
            provider_name=self.name,
            # The engine's cgroup enforces the memory limit; an address-space one too would break
            # runtimes that reserve more than they use (node).
            spec=spec.model_copy(update={"memory_limit_mb": None}),
            base_url="http://sandbox",  # through its Unix socket: any host name reaches it
            token=launch.token,
            root=ROOT_IN,
            teardown=functools.partial(self._teardown, name, session_dir, (spec, image, runtime)),
            probe=functools.partial(self._probe, name),
            marker_token=uuid.uuid4().hex,
            extra={"container": name, "image": image.ref, "engine": self.engine},
            uds=launch.socket_path,
        )

    # -- spares -----------------------------------------------------------------------------------------

    async def _claim(self, key: str) -> _Launch | None:
        """A spare container started for sandboxes like this one, if one is ready or starting (waiting
        for it is no slower than starting one); one idle past SPARE_IDLE_S is removed instead."""
        loop = asyncio.get_running_loop()
        # Those of a closed event loop: their removal is the reaper's (their agents' TTL ends them).
        self._spares = [spare for spare in self._spares if spare[0] is loop]
        while (spare := next((sp for sp in self._spares if sp[1] == key), None)) is not None:
            self._spares.remove(spare)
            try:
                launch = await asyncio.shield(spare[2])
            except Exception:
                continue  # its start failed, and removed what it began
            if time.monotonic() - launch.made > SPARE_IDLE_S:
                self._remove_later(spare[2])
                continue
            return launch
        return None

    def _want_spare(self, template: tuple[SandboxSpec, ImageInfo, Runtime | None]) -> None:
        """Start a spare like a sandbox that stopped, for the next one like it (its session's next, or
        the next session's grading sandbox): off that session's path, and off the CPU its harness was
        using. At most SPARES at once: a full set of others' makes room by its oldest; none beyond."""
        if self._closing or self._over:
            return
        loop = asyncio.get_running_loop()
        spec, image, runtime = template
        key = _spare_key(spec, image)
        self._spares = [spare for spare in self._spares if spare[0] is loop]
        if len(self._spares) >= SPARES:
            oldest = self._spares[0]
            if oldest[1] == key:
                return
            self._spares.pop(0)
            self._remove_later(oldest[2])
        self._spares.append((loop, key, loop.create_task(self._new_spare(spec, image, runtime))))

    async def _new_spare(self, spec: SandboxSpec, image: ImageInfo, runtime: Runtime | None) -> _Launch:
        # Its own session directory and labels; it lives SPARE_IDLE_S longer than a session may, so that
        # its agent's TTL (from its start) still covers the session that takes it.
        spare_spec = spec.model_copy(
            update={"session_id": f"spare-{uuid.uuid4().hex[:12]}", "ttl_s": spec.ttl_s + SPARE_IDLE_S}
        )
        launch = await self._launch(spare_spec, image, runtime)
        try:
            await self._run(launch, spare_spec, image, runtime)
        except BaseException as exc:
            await asyncio.shield(self._remove(launch.name, launch.session_dir))
            log.info("container: a spare did not start: %s", str(exc)[:300])
            raise
        return launch

    def _remove_later(self, future: asyncio.Future[_Launch]) -> None:
        async def remove_spare() -> None:
            with contextlib.suppress(Exception):
                launch = await future
                await self._remove(launch.name, launch.session_dir)

        self._remove_in_background(remove_spare())

    def _cannot_run(self, image: str, stderr: str) -> str:
        said = _one_line(stderr)
        python = self.cfg.python
        if python and (("executable file" in said and python in said) or "no such file" in said.lower()):
            return f"image {image!r} cannot host the sandbox: no {python} (>= 3.11) in it ({said})"
        if "rlimit" in said.lower():
            return (
                f"{self.engine} cannot apply its resource limits here: set sandbox.ulimits at or under this "
                f"host's hard limits (ulimit -Hn, -Hu), e.g. [nofile=1024:1024, nproc=1024:1024] ({said})"
            )
        if "hybrid mode" in said:
            return (
                f"{self.engine}'s OCI runtime refuses this host's cgroups: set sandbox.runtime: runc ({said})"
            )
        return f"{self.engine} run of image {image!r} failed: {said}"

    async def _wait_ready(self, name: str, control: Path) -> None:
        ready = control / "ready.json"
        deadline = time.monotonic() + self.cfg.start_timeout_s
        next_check = time.monotonic() + STATE_EVERY_S
        while time.monotonic() < deadline:
            if ready.exists():
                return
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + STATE_EVERY_S
                why = await self._probe(name)
                if why is not None:
                    raise SandboxStartError(why)
            await asyncio.sleep(POLL_S)
        raise SandboxStartError(f"container {name}: agent not ready within {self.cfg.start_timeout_s}s")

    async def _probe(self, name: str) -> str | None:
        proc = await asyncio.to_thread(
            _engine, self.engine, ["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name]
        )
        if proc.returncode != 0:
            return f"container {name} is gone"
        state, _, code = proc.stdout.strip().partition(" ")
        if state == "running":
            return None
        logs = await asyncio.to_thread(_engine, self.engine, ["logs", "--tail", "5", name])
        return f"container {name} is {state} (exit {code}): {_one_line(logs.stdout + logs.stderr)}"

    async def _teardown(
        self, name: str, session_dir: Path, template: tuple[SandboxSpec, ImageInfo, Runtime | None]
    ) -> None:
        """Begin removing the container and its directory, and return: a stopped sandbox's agent has
        ended its commands (or never started any), and the engine's removal (0.2-0.8 s of podman's
        unmounting, cgroup and storage work) is no part of its row. The removal is bounded
        (``remove``'s attempts) and awaited by ``finish_removals``, which the worker's close and release
        call; a worker killed meanwhile leaves the container to the reaper (its owner label)."""
        self._remove_in_background(self._remove(name, session_dir))
        self._want_spare(template)

    def _remove_in_background(self, removal: Coroutine[Any, Any, None]) -> None:
        """Run ``removal`` off the caller's path, held in ``_removals`` until ``finish_removals``."""
        task = asyncio.get_running_loop().create_task(removal)
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove(self, name: str, session_dir: Path) -> None:
        gone = await asyncio.to_thread(remove, self.engine, name)
        _forget_socket_link(name)
        if not self.cfg.keep:
            await asyncio.to_thread(shutil.rmtree, session_dir, True)
        if not gone:
            log.warning("container %s still there after %s rm -f; left to the reaper", name, self.engine)

    async def finish_removals(self) -> None:
        """Remove the spares and wait for the removals of stopped sandboxes' containers begun so far:
        a run is over (the worker's release), or the worker closes. Until a sandbox starts again, a stop
        starts no spare."""
        self._over = True
        spares, self._spares = self._spares, []
        loop = asyncio.get_running_loop()
        for spare_loop, _key, future in spares:
            if spare_loop is loop:
                self._remove_later(future)
        while self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)

    async def settle(self) -> None:
        """Wait until no removal and no spare's start is under way, spares kept (a benchmark's pause
        between rollouts, so that neither shares the machine with what it compares)."""
        while self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(f for spare_loop, _, f in self._spares if spare_loop is loop), return_exceptions=True
        )

    async def aclose(self) -> None:
        """Remove the spares and finish removing stopped sandboxes' containers; running ones are not
        affected, and no spare is started from here on."""
        self._closing = True
        await self.finish_removals()


def _ulimit_choices() -> list[list[str]]:
    """Open-files and processes limits for an engine told none, highest first: as root, podman asks for
    more than this host allows and runc cannot raise them without CAP_SYS_RESOURCE (every start fails
    with an "rlimit" error). The worker's own limits, then those capped at 65536 / 32768, then 1024
    each; the provider keeps the first that starts a container."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    infinite = resource.RLIM_INFINITY
    choices = []
    for cap_files, cap_procs in ((None, None), (65_536, 32_768), (1024, 1024)):
        files = nofile if cap_files is None or (nofile != infinite and nofile < cap_files) else cap_files
        procs = nproc if cap_procs is None or (nproc != infinite and nproc < cap_procs) else cap_procs
        limits = [
            f"nofile={files}:{files}" if files != infinite else "",
            f"nproc={procs}:{procs}" if procs != infinite else "",
        ]
        choice = [limit for limit in limits if limit]
        if choice not in choices:
            choices.append(choice)
    return choices


def _host_gpus() -> bool:
    return Path("/dev/nvidia0").exists()


@functools.cache
def _storage_unenforced(storage_mb: int) -> None:
    log.warning(
        "container: a task's storage_mb (%d) is not enforced; sandbox.storage_limits: true passes it as "
        "--storage-opt size= (needs overlay on xfs with pquota)",
        storage_mb,
    )


def _venv_interpreters(venvs: Path) -> list[Path]:
    """The installations the cache's virtualenvs run on (a venv's python is a link to its interpreter):
    mounted read-only too, a Python harness (Hermes) runs in any image with a compatible C library."""
    homes: set[Path] = set()
    with contextlib.suppress(OSError):
        for cfg in venvs.glob("*/pyvenv.cfg"):
            for line in cfg.read_text(encoding="utf-8").splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home" and Path(value.strip()).is_absolute():
                    homes.add(Path(value.strip()).parent)  # <prefix>/bin -> <prefix>
    return sorted(home for home in homes if home.is_dir() and home != Path("/") and home != Path("/usr"))


def _socket_path(path: Path, name: str) -> str:
    """A Unix socket's path as connect() takes it: at most 107 bytes. A longer one is reached through a
    short symlink to its directory (connect() follows it), removed at teardown."""
    if len(os.fsencode(path)) < 100:
        return str(path)
    _LINK_DIR.mkdir(mode=0o700, exist_ok=True)
    link = _LINK_DIR / name
    link.unlink(missing_ok=True)
    link.symlink_to(path.parent)
    return str(link / path.name)


def _forget_socket_link(name: str) -> None:
    """Remove container ``name``'s short link (``_socket_path``), if one was made."""
    (_LINK_DIR / name).unlink(missing_ok=True)


__all__ = ["ContainerSandboxConfig", "ContainerSandboxProvider", "list_containers", "reap_containers"]
