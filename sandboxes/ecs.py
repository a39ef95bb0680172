"""The ``ecs`` sandbox: one ECS task per session whose container runs the in-sandbox agent.

``RunTask`` (one task per call, since each carries its own token; ``clientToken`` makes a retried call
idempotent; ``startedBy`` and tags carry the run id and the owner), ``DescribeTasks`` until the task is
RUNNING and its agent answers, ``StopTask`` at the end. Why a task stopped is read from ``stopCode`` and
``stoppedReason``: before readiness it is a failed start, after it a lost sandbox. Launches go through a
token bucket within ECS's RunTask limits. The token reaches the agent as an environment override, which
``ecs:DescribeTasks`` can read: grant that permission only to the workers (cluster/ecs/README.md).

The agent, root in its container, runs the commands as the unprivileged ``run_as`` (the image makes the
user, cluster/ecs/Dockerfile), so they can read neither its environment (the token) nor anything of
root's. A task's role would hand its credentials to anything in the task that asks the container
credentials endpoint (169.254.170.2, named by AWS_CONTAINER_CREDENTIALS_RELATIVE_URI in the container's
environment): no process of the task's network can be kept from that address on Fargate, so a sandbox
task must have no role at all, and a task definition with one is refused (``isolation: off`` allows it).

boto3 is optional (``pip install .[ecs]``); it is imported when a provider is built.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sandboxes.base import SandboxError, SandboxSpec, SandboxStartError
from sandboxes.identity import SANDBOX_USER
from sandboxes.owner import Owner, hold
from sandboxes.provider_config import NetworkForward, ProviderConfig
from sandboxes.remote import RemoteSandbox, agent_health

log = logging.getLogger(__name__)

TOKEN_ENV = "ROLLOUT_AGENT_TOKEN"
RUN_TAG, SESSION_TAG, TTL_TAG = "rollout:run", "rollout:session", "rollout:ttl"
IMAGE_TAG = "rollout:image"
OWNER_TAG_PREFIX = "rollout:owner:"  # host, boot, pid, ticks, record (sandboxes/owner.py)
# ECS's limits: 50 tags a task, keys of 128 characters, values of 256. Ours: 8 tags, keys under 30, and
# values short but for the run and session ids (cut to fit; the run is also in startedBy).
TAG_VALUE_MAX = 256
# Transient answers of the ECS API: the same call (same clientToken) is tried again.
RETRYABLE_CODES = {
    "ThrottlingException",
    "ServerException",
    "ServiceUnavailableException",
    "LimitExceededException",
}
# failures[] reasons that mean "no room right now" rather than a broken request.
CAPACITY_REASONS = ("RESOURCE:", "AGENT", "capacity", "Capacity")

AddressResolver = Callable[[dict[str, Any]], "tuple[str, int] | None"]


class EcsSandboxConfig(ProviderConfig):
    provider: Literal["ecs"] = "ecs"
    cluster: str
    task_definition: str  # family[:revision] or ARN
    container_name: str = "sandbox"
    launch_type: Literal["FARGATE", "EC2"] | None = "FARGATE"
    capacity_provider_strategy: list[dict[str, Any]] = Field(default_factory=list)  # e.g. FARGATE_SPOT
    subnets: list[str] = Field(default_factory=list)
    security_groups: list[str] = Field(default_factory=list)
    assign_public_ip: bool = False
    region: str | None = None
    endpoint_url: str | None = None
    agent_port: int = Field(default=8080, ge=1, le=65_535)
    agent_python: str = "python3"
    agent_path: str = "/opt/rollout/agent.py"  # where the image has the agent (cluster/ecs/Dockerfile)
    sandbox_root: str = "/sandbox"  # inside the container
    launch_burst: int = Field(default=100, ge=1)
    launch_rate_per_s: float = Field(default=20.0, gt=0)
    max_launch_attempts: int = Field(default=6, ge=1, le=50)
    start_timeout_s: float = Field(default=600.0, gt=0)
    poll_s: float = Field(default=2.0, gt=0)
    # auto: the commands run as ``run_as`` and the task definition must have no task role, plus whatever
    # layers the task's kernel lets the agent make (none on Fargate: no CAP_SYS_ADMIN); strict: all of
    # them or no sandbox; off: the agent's own user, any task definition.
    isolation: Literal["auto", "strict", "off"] = "auto"
    run_as: str = SANDBOX_USER

    def build(self, root: Path, network_forward: NetworkForward | None = None) -> EcsSandboxProvider:
        return EcsSandboxProvider(self, root=root)

    def reap(self, root: Path, run_id: str | None, *, everything: bool = False) -> list[str]:
        return EcsSandboxProvider(self, root=root).reap(run_id, everything=everything)


def started_by(run_id: str) -> str:
    """ECS allows 36 characters of [A-Za-z0-9_/-] here; a digest of the run id fits any run id."""
    return "rollout-" + hashlib.sha256(run_id.encode()).hexdigest()[:20]


def _family(task_definition: str) -> str:
    """The family of ``family[:revision]`` or of a task definition's ARN."""
    return task_definition.rsplit("/", 1)[-1].split(":", 1)[0]


def image_family_prefix(task_definition: str, run_id: str) -> str:
    """The families a run registers for its tasks' images begin so: ``rollout gc`` finds them by it."""
    return f"{_family(task_definition)}-{started_by(run_id)}-"


def image_family(task_definition: str, run_id: str, image: str) -> str:
    """The run's task definition family for ``image``: the base's, one per run and distinct image."""
    return image_family_prefix(task_definition, run_id) + hashlib.sha256(image.encode()).hexdigest()[:16]


# What a registered task definition carries that RegisterTaskDefinition takes again.
_REGISTER_KEYS = (
    "taskRoleArn", "executionRoleArn", "networkMode", "volumes", "placementConstraints",
    "requiresCompatibilities", "cpu", "memory", "pidMode", "ipcMode", "proxyConfiguration",
    "inferenceAccelerators", "ephemeralStorage", "runtimePlatform",
)  # fmt: skip


class TokenBucket:
    """``burst`` launches at once, then ``rate`` per second. Fair to waiters in arrival order."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.stamp = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def acquire(self) -> None:
        async with self._lock:
            self._refill()
            if self.tokens < 1:
                await asyncio.sleep((1 - self.tokens) / self.rate)
                self._refill()
            self.tokens -= 1


def describe_stop(task: dict[str, Any]) -> str:
    """One line on why a task stopped: ECS's stop code and reason, and the container's exit."""
    exits = [
        f"{c.get('name')} exit {c.get('exitCode')}" + (f" ({c['reason']})" if c.get("reason") else "")
        for c in task.get("containers", [])
    ]
    text = f"ECS task {task.get('taskArn', '?')} stopped: {task.get('stopCode', 'unknown')}"
    text += f": {task.get('stoppedReason', '')}"
    return (text + ("; " + ", ".join(exits) if exits else ""))[:2000]


def default_address(task: dict[str, Any], port: int) -> tuple[str, int] | None:
    """The task's private IP (awsvpc network mode) and the agent's port."""
    for attachment in task.get("attachments", []):
        for detail in attachment.get("details", []):
            if detail.get("name") == "privateIPv4Address" and detail.get("value"):
                return detail["value"], port
    return None


class EcsSandboxProvider:
    isolation_label: str | None = None  # each sandbox's agent says (RemoteSandbox)

    def __init__(
        self,
        config: EcsSandboxConfig,
        *,
        root: Path | None = None,
        client: Any = None,
        resolve: AddressResolver | None = None,
    ) -> None:
        self.cfg = config
        self.name = "ecs"
        # Only the owner records go here (the worker's own machine): a task's tags name its owner's, and a
        # reaper on this machine proves the owner dead by the record's lock.
        self.root = Path(root) if root is not None else config.root_dir()
        if client is None:
            import boto3  # optional dependency: only ECS runs need it

            client = boto3.client("ecs", region_name=config.region, endpoint_url=config.endpoint_url)
        self.client = client
        self.resolve: AddressResolver = resolve or (lambda task: default_address(task, config.agent_port))
        self.bucket = TokenBucket(config.launch_rate_per_s, config.launch_burst)
        self._definitions: dict[str, str] = {}  # image -> the ARN of its task definition, this run's
        self._roleless: set[str] = set()  # the task definitions found to have no task role
        self._definition_locks: dict[str, asyncio.Lock] = {}

    async def task_definition(self, spec: SandboxSpec) -> str:
        """The task definition a session runs: the configured one, or for a task's own image one
        registered from it with that image, once per run and image (found again by its family by other
        workers and after a restart), so ECS's API sees a handful of calls per distinct image."""
        if spec.build_context is not None:
            raise SandboxStartError(
                f"a task's build ({spec.build_context}) needs sandbox.provider 'container'; give an image"
            )
        if not spec.image:
            return self.cfg.task_definition
        if (arn := self._definitions.get(spec.image)) is not None:
            return arn
        async with self._definition_locks.setdefault(spec.image, asyncio.Lock()):
            if spec.image not in self._definitions:
                try:
                    self._definitions[spec.image] = await self._register(spec.run_id, spec.image)
                except SandboxError as exc:
                    raise SandboxStartError(f"task definition for image {spec.image!r}: {exc}") from exc
            return self._definitions[spec.image]

    async def _register(self, run_id: str, image: str) -> str:
        family = image_family(self.cfg.task_definition, run_id, image)
        try:
            found = (await self._call("describe_task_definition", taskDefinition=family))["taskDefinition"]
            if found.get("status") == "ACTIVE":
                return found["taskDefinitionArn"]
        except SandboxError:
            pass  # none yet
        base = (await self._call("describe_task_definition", taskDefinition=self.cfg.task_definition))[
            "taskDefinition"
        ]
        containers = [dict(c) for c in base.get("containerDefinitions", [])]
        ours = [c for c in containers if c.get("name") == self.cfg.container_name]
        if not ours:
            raise SandboxError(
                f"{self.cfg.task_definition} has no container named {self.cfg.container_name!r}"
            )
        ours[0]["image"] = image
        answer = await self._call(
            "register_task_definition",
            family=family,
            containerDefinitions=containers,
            tags=[
                {"key": RUN_TAG, "value": run_id[:TAG_VALUE_MAX]},
                {"key": IMAGE_TAG, "value": image[:256]},
            ],
            **{k: base[k] for k in _REGISTER_KEYS if k in base},
        )
        log.info("ecs: registered %s for image %s", family, image)
        return answer["taskDefinition"]["taskDefinitionArn"]

    def deregister_images(self, run_id: str) -> list[str]:
        """Deregister the task definitions ``run_id`` registered for its tasks' images."""
        prefix = image_family_prefix(self.cfg.task_definition, run_id)
        bound = {"PaginationConfig": {"MaxItems": 10_000}}
        families: list[str] = []
        # ListTaskDefinitions takes a whole family name; ListTaskDefinitionFamilies a prefix.
        for page in self.client.get_paginator("list_task_definition_families").paginate(
            familyPrefix=prefix, status="ACTIVE", **bound
        ):
            families.extend(f for f in page.get("families", []) if f.startswith(prefix))
        arns: list[str] = []
        for family in families:
            for page in self.client.get_paginator("list_task_definitions").paginate(
                familyPrefix=family, status="ACTIVE", **bound
            ):
                arns.extend(page.get("taskDefinitionArns", []))
        for arn in arns:
            self.client.deregister_task_definition(taskDefinition=arn)
        return arns

    # -- API calls, retried when ECS says so -----------------------------------------------------------

    async def _call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(1, self.cfg.max_launch_attempts + 1):
            try:
                return await asyncio.to_thread(getattr(self.client, op), **kwargs)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code not in RETRYABLE_CODES or attempt == self.cfg.max_launch_attempts:
                    raise SandboxError(f"ECS {op}: {code}: {str(exc)[:1000]}") from exc
            except BotoCoreError as exc:
                if attempt == self.cfg.max_launch_attempts:
                    raise SandboxError(f"ECS {op}: {str(exc)[:1000]}") from exc
            await asyncio.sleep(random.uniform(0, min(8.0, 0.2 * 2**attempt)))
        raise AssertionError("unreachable")

    def _run_task_args(
        self, spec: SandboxSpec, token: str, owner: Owner, task_definition: str | None = None
    ) -> dict[str, Any]:
        cfg = self.cfg
        tags = {
            RUN_TAG: spec.run_id,
            SESSION_TAG: spec.session_id,
            TTL_TAG: str(int(time.time() + spec.ttl_s)),
            **{OWNER_TAG_PREFIX + k: v for k, v in owner.encode().items()},
        }
        command = [
            cfg.agent_python, cfg.agent_path,
            "--root", cfg.sandbox_root,
            "--token-env", TOKEN_ENV,
            "--host", "0.0.0.0",
            "--port", str(cfg.agent_port),
            "--ttl-s", f"{spec.ttl_s:.0f}",
        ]  # fmt: skip
        if cfg.isolation != "off":
            command += ["--isolation", cfg.isolation, "--run-as", cfg.run_as]
        args: dict[str, Any] = {
            "cluster": cfg.cluster,
            "taskDefinition": task_definition or cfg.task_definition,
            "count": 1,
            "startedBy": started_by(spec.run_id),
            "clientToken": uuid.uuid4().hex,  # the same for every retry of this launch
            "tags": [{"key": k, "value": v[:TAG_VALUE_MAX]} for k, v in tags.items()],
            "overrides": {
                "containerOverrides": [
                    {
                        "name": cfg.container_name,
                        "command": command,
                        "environment": [{"name": TOKEN_ENV, "value": token}],
                    }
                ]
            },
        }
        # A task's own CPUs and memory, as ECS counts them (CPU units, MiB), where the launch type allows.
        if spec.cpus:
            args["overrides"]["cpu"] = str(int(spec.cpus * 1024))
        if spec.memory_limit_mb:
            args["overrides"]["memory"] = str(spec.memory_limit_mb)
        if cfg.capacity_provider_strategy:
            args["capacityProviderStrategy"] = cfg.capacity_provider_strategy
        elif cfg.launch_type:
            args["launchType"] = cfg.launch_type
        if cfg.subnets:
            args["networkConfiguration"] = {
                "awsvpcConfiguration": {
                    "subnets": cfg.subnets,
                    "securityGroups": cfg.security_groups,
                    "assignPublicIp": "ENABLED" if cfg.assign_public_ip else "DISABLED",
                }
            }
        return args

    # -- the provider ------------------------------------------------------------------------------------

    async def start(self, spec: SandboxSpec) -> RemoteSandbox:
        try:
            owner = Owner.current(hold(self.root))  # once per process: later calls are a lookup and an fstat
        except OSError as exc:
            raise SandboxStartError(f"cannot make an owner record under {self.root}: {exc}") from exc
        definition = await self.task_definition(spec)
        if self.cfg.isolation != "off":
            await self._check_no_role(definition)
        await self.bucket.acquire()
        token = secrets.token_urlsafe(32)
        try:
            answer = await self._call("run_task", **self._run_task_args(spec, token, owner, definition))
        except SandboxError as exc:
            raise SandboxStartError(str(exc)) from exc
        tasks, failures = answer.get("tasks", []), answer.get("failures", [])
        if not tasks:
            reasons = "; ".join(f"{f.get('reason')}: {f.get('detail', '')}".strip() for f in failures)
            kind = "no capacity" if any(r in reasons for r in CAPACITY_REASONS) else "refused"
            raise SandboxStartError(f"ECS RunTask {kind}: {reasons or 'no task and no failure given'}"[:2000])
        arn = tasks[0]["taskArn"]
        try:
            host, port = await self._wait_running(arn)
            base_url = f"http://{host}:{port}"
            health = await self._wait_healthy(base_url, token, arn)
            return RemoteSandbox(
                sandbox_id=f"ecs-{arn.rsplit('/', 1)[-1]}",
                provider_name=self.name,
                spec=spec,
                base_url=base_url,
                token=token,
                root=str(health.get("root") or self.cfg.sandbox_root),
                teardown=lambda: self._stop_task(arn, "rollout: session ended"),
                probe=lambda: self._probe(arn),
                marker_token=uuid.uuid4().hex,
                extra={"task_arn": arn, "cluster": self.cfg.cluster},
            )
        except BaseException as exc:
            await asyncio.shield(self._stop_task(arn, "rollout: start failed"))
            if isinstance(exc, SandboxStartError) or not isinstance(exc, Exception):
                raise
            raise SandboxStartError(f"ECS task {arn}: {exc}"[:2000]) from exc

    async def _check_no_role(self, definition: str) -> None:
        """Refuse a task definition with a task role: the role's credentials would be one request to
        169.254.170.2 away from every command. Asked once per definition."""
        if definition in self._roleless:
            return
        try:
            found = await self._call("describe_task_definition", taskDefinition=definition)
        except SandboxError as exc:
            raise SandboxStartError(str(exc)) from exc
        role = found["taskDefinition"].get("taskRoleArn")
        if role:
            raise SandboxStartError(
                f"task definition {definition} has the task role {role}: its credentials would be readable "
                "by the sandbox's commands at 169.254.170.2; give sandbox tasks no role (or isolation: off)"
            )
        self._roleless.add(definition)

    async def _describe(self, arn: str) -> dict[str, Any] | None:
        answer = await self._call("describe_tasks", cluster=self.cfg.cluster, tasks=[arn])
        tasks = answer.get("tasks", [])
        return tasks[0] if tasks else None

    async def _wait_running(self, arn: str) -> tuple[str, int]:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            task = await self._describe(arn)
            if task is None:
                raise SandboxStartError(f"ECS task {arn} is unknown to DescribeTasks")
            if task.get("lastStatus") == "STOPPED":
                raise SandboxStartError(describe_stop(task))
            if task.get("lastStatus") == "RUNNING":
                address = await asyncio.to_thread(self.resolve, task)
                if address is not None:
                    return address
            await asyncio.sleep(self.cfg.poll_s)
        raise SandboxStartError(f"ECS task {arn} not running within {self.cfg.start_timeout_s}s")

    async def _wait_healthy(self, base_url: str, token: str, arn: str) -> dict[str, Any]:
        import httpx  # here: a driver imports the provider configs only

        # RUNNING means the container started, not that the agent listens yet.
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while True:
            try:
                return await agent_health(base_url, token)
            except (SandboxError, httpx.HTTPError, ValueError) as exc:
                if time.monotonic() >= deadline:
                    raise SandboxStartError(f"ECS task {arn}: agent never answered: {exc}") from exc
                task = await self._describe(arn)
                if task is not None and task.get("lastStatus") == "STOPPED":
                    raise SandboxStartError(describe_stop(task)) from exc
            await asyncio.sleep(min(self.cfg.poll_s, 0.5))

    async def _probe(self, arn: str) -> str | None:
        task = await self._describe(arn)
        if task is None:
            return f"ECS task {arn} is gone"
        if (
            task.get("lastStatus") in ("STOPPED", "DEPROVISIONING", "STOPPING")
            or task.get("desiredStatus") == "STOPPED"
        ):
            return describe_stop(task)
        return None

    async def _stop_task(self, arn: str, reason: str) -> None:
        task = await self._describe(arn)
        if task is not None and task.get("lastStatus") == "STOPPED":
            return
        await self._call("stop_task", cluster=self.cfg.cluster, task=arn, reason=reason)

    # -- reaping -----------------------------------------------------------------------------------------

    def reap(self, run_id: str | None, *, everything: bool = False, now: float | None = None) -> list[str]:
        """Stop the rollout tasks past their TTL or whose owner this machine proves dead by its record
        under the root; ``everything``: all of ``run_id``'s, and the task definitions it registered for
        its tasks' images are deregistered."""
        if everything and run_id is None:
            raise ValueError("reaping everything needs a run id")
        now = time.time() if now is None else now
        query: dict[str, Any] = {"cluster": self.cfg.cluster, "desiredStatus": "RUNNING"}
        if run_id is not None:
            query["startedBy"] = started_by(run_id)
        arns: list[str] = []
        for page in self.client.get_paginator("list_tasks").paginate(
            **query, PaginationConfig={"MaxItems": 10_000}
        ):
            arns.extend(page.get("taskArns", []))
        stopped = []
        for i in range(0, len(arns), 100):  # DescribeTasks takes at most 100
            answer = self.client.describe_tasks(
                cluster=self.cfg.cluster, tasks=arns[i : i + 100], include=["TAGS"]
            )
            for task in answer.get("tasks", []):
                tags = {t["key"]: t["value"] for t in task.get("tags", [])}
                if RUN_TAG not in tags or (run_id is not None and tags[RUN_TAG] != run_id):
                    continue
                owner = Owner.decode(
                    {k[len(OWNER_TAG_PREFIX) :]: v for k, v in tags.items() if k.startswith(OWNER_TAG_PREFIX)}
                )
                ttl = tags.get(TTL_TAG, "")
                expired = ttl.isdigit() and now > int(ttl)
                if everything or expired or (owner is not None and owner.known_dead(self.root)):
                    self.client.stop_task(
                        cluster=self.cfg.cluster, task=task["taskArn"], reason="rollout: reaped"
                    )
                    stopped.append(task["taskArn"])
        if everything and run_id is not None:  # the run is over: its images' task definitions go too
            stopped += self.deregister_images(run_id)
        return stopped
