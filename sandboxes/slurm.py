"""The ``slurm`` sandbox: one batch job per session, running the in-sandbox agent on a compute node.

The session's directory sits on a filesystem the worker and the compute nodes share::

    <root>/<run_id>/<session_id>/
        work/ home/ tmp/ logs/ run/     the agent's sandbox tree (see sandboxes/agent.py)
        control/                        0700: lib/ (agent.py, supervisor.py and their imports), token
                                        (0600), job.sh, ready.json (the agent's rendezvous), slurm-<job>.out

The token is written by the worker into ``control/token`` and read by the agent from there, so it never
appears on a command line ``squeue`` or ``ps`` shows. The job is named ``rollout.<run_id>``, its comment
carries the owner (host, boot, pid, start ticks, and its record under ``<root>/owners/``) and the TTL
deadline, and ``--time`` is the TTL: a reaper needs ``squeue`` to find what a dead worker left and, on the
worker's machine, the record's lock to know it dead (sandboxes/owner.py); Slurm ends the job at its TTL
regardless.

The agent isolates the session's commands on the node as ``isolation`` says (sandboxes/agent_layers.py):
started as root (the job's user is the worker's), it runs them as ``run_as``, in a PID namespace, a
loopback-only network that reaches only the worker's gateway, and a view of the node that hides its
secrets (munge's key, Slurm's spool and configuration, homes, this provider's root with every session's
token); as another user it cannot, and says so (``strict``: the job ends before its agent is ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from sandboxes.base import SandboxError, SandboxSpec, SandboxStartError, check_session_names
from sandboxes.cache_root import default_cache_root
from sandboxes.identity import SANDBOX_USER
from sandboxes.owner import Owner, hold
from sandboxes.provider_config import NetworkForward, ProviderConfig
from sandboxes.remote import RemoteSandbox, agent_files, ready_or_torn_down

log = logging.getLogger(__name__)

JOB_PREFIX = "rollout."
COMMAND_TIMEOUT_S = 30.0
POLL_S = 0.05
SQUEUE_EVERY_S = 1.0
GONE_TIMEOUT_S = 30.0
# What slurmctld accepts in --comment (22.05 refuses 1025 characters). Ours is ~160 at most: a host name
# (64 on Linux), a boot id's 8, a pid, start ticks, the owner record's 16 and the TTL deadline.
COMMENT_MAX = 1024
# Job states in which the job is, or may still be, running something of ours.
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


class SlurmSandboxConfig(ProviderConfig):
    provider: Literal["slurm"] = "slurm"
    partition: str | None = None
    sbatch_args: list[str] = Field(
        default_factory=list
    )  # e.g. ["--cpus-per-task=2", "--mem=4G", "--oversubscribe"]
    python: str = "python3"  # on the compute node (inside the image with apptainer); >= 3.11
    # Run the agent inside this image (the root is bound in); a task's own `image` wins, handed to
    # apptainer as it is (a .sif path, docker://..., oras://...).
    apptainer_image: str | None = None
    apptainer_args: list[str] = Field(default_factory=list)
    agent_host: str = "127.0.0.1"  # the agent's bind address; not loopback: it advertises the node name
    start_timeout_s: float = 300.0  # queueing included
    # The layers the agent gives the commands on the node (sandboxes/agent_layers.py): auto, every one
    # the node allows (saying once which it cannot); strict, every one or no sandbox; off, none.
    isolation: Literal["auto", "strict", "off"] = "auto"
    run_as: str = SANDBOX_USER  # the unprivileged user the commands run as; it must exist on the nodes
    # More paths on the nodes no command may see (on top of homes, /root, /run, /tmp, munge's and
    # Slurm's directories and the sandbox root), e.g. a shared filesystem's secrets.
    hide: list[str] = Field(default_factory=list)

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> SlurmSandboxProvider:
        return SlurmSandboxProvider(root, self)

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        return reap_jobs(root, run_id, everything=everything)


def _run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"{argv[0]}: {exc}") from exc


def job_state(job_id: str) -> str | None:
    """The job's state as squeue shows it; None once squeue no longer knows the job."""
    proc = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SandboxError(f"squeue -j {job_id} failed: {proc.stderr.strip()[:500]}")
    return proc.stdout.strip() or None


def cancel(job_id: str, *, wait_s: float = GONE_TIMEOUT_S) -> bool:
    """scancel, then wait (bounded) until the job has left the live states. True if it has."""
    _run(["scancel", job_id])
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if job_state(job_id) not in LIVE_STATES:
            return True
        time.sleep(0.2)
    return False


def _comment(owner: Owner, ttl_deadline: float) -> str:
    fields = {**owner.encode(), "ttl": str(int(ttl_deadline))}
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _parse_comment(comment: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in comment.split() if "=" in part)


def list_jobs(run_id: str | None = None) -> list[tuple[str, str, dict[str, str]]]:
    """(job id, run id, comment fields) of every live rollout job, of one run if ``run_id`` is given."""
    proc = _run(["squeue", "-h", "-o", "%i|%T|%k|%j"])
    if proc.returncode != 0:
        raise SandboxError(f"squeue failed: {proc.stderr.strip()[:500]}")
    jobs = []
    for line in proc.stdout.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4 or not parts[3].startswith(JOB_PREFIX) or parts[1] not in LIVE_STATES:
            continue
        job_run = parts[3][len(JOB_PREFIX) :]
        if run_id is None or job_run == run_id:
            jobs.append((parts[0], job_run, _parse_comment(parts[2])))
    return jobs


def reap_jobs(
    root: Path, run_id: str | None = None, *, everything: bool = False, now: float | None = None
) -> list[str]:
    """Cancel the rollout jobs whose owner this host proves dead by its record under ``root`` (the
    sandbox root the owner's provider was built on), or whose TTL passed; with ``everything``, every job of
    ``run_id``. Returns the job ids cancelled."""
    if everything and run_id is None:
        raise ValueError("reaping everything needs a run id")
    now = time.time() if now is None else now
    reaped = []
    for job_id, _run_id, fields in list_jobs(run_id):
        owner = Owner.decode(fields)
        expired = "ttl" in fields and fields["ttl"].isdigit() and now > int(fields["ttl"])
        if everything or expired or (owner is not None and owner.known_dead(root)):
            if cancel(job_id):
                reaped.append(job_id)
            else:
                log.warning("slurm job %s survived scancel", job_id)
    return reaped


class SlurmSandboxProvider:
    isolation_label: str | None = None  # each sandbox's agent says (RemoteSandbox)

    def __init__(self, root: Path, config: SlurmSandboxConfig) -> None:
        self.root = Path(root).resolve()
        self.cfg = config
        self.name = "slurm"

    def _job_script(self, session_dir: Path, control: Path, ttl_s: float, image: str | None = None) -> str:
        agent = [
            self.cfg.python,
            str(control / "lib" / "agent.py"),
            "--root", str(session_dir),
            "--token-file", str(control / "token"),
            "--rendezvous", str(control / "ready.json"),
            "--ttl-s", f"{ttl_s:.0f}",
            "--host", self.cfg.agent_host,
        ]  # fmt: skip
        if self.cfg.isolation != "off":
            agent += [
                "--isolation",
                self.cfg.isolation,
                "--run-as",
                self.cfg.run_as,
                "--uid-pool",  # as root, a uid of the node's pool: no signal or file shared with a job
                "--hide",
                str(self.root),
            ]
            # The harnesses the worker computes paths into, read-only (the sandbox root in it stays hidden).
            agent += ["--readonly", str(default_cache_root())]
            agent += [arg for path in self.cfg.hide for arg in ("--hide", path)]
        if image := image or self.cfg.apptainer_image:
            bind = ["--bind", f"{session_dir}:{session_dir}"]
            agent = ["apptainer", "exec", *bind, *self.cfg.apptainer_args, image, *agent]
        line = shlex.join(agent)
        if self.cfg.agent_host not in ("127.0.0.1", "localhost", "::1"):
            line += ' --advertise "$(hostname)"'
        return (
            "#!/bin/sh\n"
            "# A rollout sandbox: the in-sandbox agent, until it is stopped, cancelled or its TTL ends.\n"
            "export PATH=/usr/local/bin:/usr/bin:/bin\n"
            f"exec {line}\n"
        )

    def _prepare(self, spec: SandboxSpec, session_dir: Path) -> tuple[Path, str]:
        control = session_dir / "control"
        session_dir.parent.mkdir(parents=True, exist_ok=True)
        session_dir.mkdir(mode=0o700)
        control.mkdir(mode=0o700)
        # Apart from the token: every command's view binds the agent's code back read-only.
        (control / "lib").mkdir(mode=0o755)
        for src in agent_files():
            shutil.copy2(src, control / "lib" / src.name)
        token = secrets.token_urlsafe(32)
        fd = os.open(control / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        (control / "job.sh").write_text(self._job_script(session_dir, control, spec.ttl_s, spec.image))
        return control, token

    def _submit(self, spec: SandboxSpec, session_dir: Path, control: Path, owner_name: str) -> str:
        minutes = max(1, math.ceil(spec.ttl_s / 60))
        argv = [
            "sbatch", "--parsable",
            f"--job-name={JOB_PREFIX}{spec.run_id}",
            f"--time={minutes}",
            f"--comment={_comment(Owner.current(owner_name), time.time() + spec.ttl_s)}",
            f"--output={control}/slurm-%j.out",
            f"--chdir={session_dir}",
            "--export=NONE",
        ]  # fmt: skip
        if self.cfg.partition:
            argv.append(f"--partition={self.cfg.partition}")
        argv += [*self.cfg.sbatch_args, str(control / "job.sh")]
        proc = _run(argv)
        if proc.returncode != 0:
            raise SandboxStartError(f"sbatch failed: {proc.stderr.strip()[:1000]}")
        return proc.stdout.strip().split(";")[0]

    async def start(self, spec: SandboxSpec) -> RemoteSandbox:
        if spec.build_context is not None:
            where = spec.build_context
            raise SandboxStartError(
                f"a task's build ({where}) needs sandbox.provider 'container'; give an image"
            )
        check_session_names(spec)
        session_dir = self.root / spec.run_id / spec.session_id
        try:
            # Once per process (later calls are a lookup and an fstat); on the shared root, so that a
            # reaper on this host proves this process's death by the record's lock, not by a pid.
            owner_name = await asyncio.to_thread(hold, self.root)
        except OSError as exc:
            raise SandboxStartError(f"cannot make an owner record under {self.root}: {exc}") from exc
        try:
            control, token = await asyncio.to_thread(self._prepare, spec, session_dir)
        except FileExistsError as exc:
            raise SandboxStartError(f"sandbox directory {session_dir} already exists") from exc
        except OSError as exc:
            raise SandboxStartError(f"cannot lay out sandbox directory {session_dir}: {exc}") from exc
        job_id = await asyncio.to_thread(self._submit, spec, session_dir, control, owner_name)

        async def build() -> RemoteSandbox:
            ready = await self._wait_ready(job_id, control)
            return RemoteSandbox(
                sandbox_id=f"slurm-{job_id}",
                provider_name=self.name,
                spec=spec,
                base_url=f"http://{ready['host']}:{ready['port']}",
                token=token,
                root=str(session_dir),
                teardown=lambda: self._teardown(job_id, session_dir),
                probe=lambda: self._probe(job_id, control),
                marker_token=uuid.uuid4().hex,
                extra={"job_id": job_id, "node": ready.get("node")},
            )

        return await ready_or_torn_down(
            build, lambda: self._teardown(job_id, session_dir), f"slurm job {job_id}"
        )

    async def _wait_ready(self, job_id: str, control: Path) -> dict[str, object]:
        ready_path = control / "ready.json"
        deadline = time.monotonic() + self.cfg.start_timeout_s
        next_check = time.monotonic() + SQUEUE_EVERY_S
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return json.loads(ready_path.read_text())
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + SQUEUE_EVERY_S
                state = await asyncio.to_thread(job_state, job_id)
                if state not in LIVE_STATES and not ready_path.exists():
                    raise SandboxStartError(
                        f"slurm job {job_id} ended ({state or 'gone'}) before its agent was ready: "
                        f"{_job_output(control, job_id)}"
                    )
            await asyncio.sleep(POLL_S)
        raise SandboxStartError(f"slurm job {job_id}: agent not ready within {self.cfg.start_timeout_s}s")

    async def _probe(self, job_id: str, control: Path) -> str | None:
        state = await asyncio.to_thread(job_state, job_id)
        if state in LIVE_STATES:
            return None
        return f"slurm job {job_id} is {state or 'gone'}: {_job_output(control, job_id)}"

    async def _teardown(self, job_id: str, session_dir: Path) -> None:
        gone = await asyncio.to_thread(cancel, job_id)
        if not self.cfg.keep:
            await asyncio.to_thread(shutil.rmtree, session_dir, ignore_errors=True)
        if not gone:
            raise SandboxError(f"slurm job {job_id} still live after scancel")


def _job_output(control: Path, job_id: str) -> str:
    try:
        with open(control / f"slurm-{job_id}.out", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 2000))
            return f.read().decode(errors="replace").strip() or "(no output)"
    except OSError:
        return "(no output)"


__all__ = ["SlurmSandboxConfig", "SlurmSandboxProvider", "cancel", "job_state", "list_jobs", "reap_jobs"]
