"""The ecs provider: the real boto3 client against moto (EC2 launch type) or botocore's Stubber, with the
in-sandbox agent running as a local process in place of the container. Only AWS itself is simulated."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from botocore.stub import ANY, Stubber  # noqa: E402

from sandboxes.base import SandboxLostError, SandboxSpec, SandboxStartError  # noqa: E402
from sandboxes.ecs import (  # noqa: E402
    OWNER_TAG_PREFIX,
    RUN_TAG,
    TOKEN_ENV,
    TTL_TAG,
    EcsSandboxConfig,
    EcsSandboxProvider,
    TokenBucket,
    started_by,
)
from sandboxes.owner import Owner, hold  # noqa: E402
from sandboxes.remote import agent_files  # noqa: E402
from tests.agent_process import AgentProcess, start_agent  # noqa: E402
from tests.test_shared_root import REPO, needs_pid_namespace, python  # noqa: E402

REGION = "us-east-1"
CLUSTER = "rollouts"


class LocalContainers:
    """Stands in for ECS's container runtime: the first time a task is seen RUNNING, its agent starts
    here with the token from the task's overrides, and its address is what the provider dials."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agents: dict[str, AgentProcess] = {}

    def resolve(self, task: dict[str, Any]) -> tuple[str, int] | None:
        arn = task["taskArn"]
        if arn not in self.agents:
            env = {
                e["name"]: e["value"]
                for o in task["overrides"]["containerOverrides"]
                for e in o.get("environment", [])
            }
            command = task["overrides"]["containerOverrides"][0]["command"]
            # The isolation the task's command asks its agent for, as the container would run it.
            layers = command[command.index("--isolation") :] if "--isolation" in command else []
            self.agents[arn] = start_agent(self.root / arn.rsplit("/", 1)[-1], env[TOKEN_ENV], *layers)
        agent = self.agents[arn]
        return agent.host, agent.port

    def kill_all(self) -> None:
        for agent in self.agents.values():
            agent.kill()


@pytest.fixture
def ecs():
    from moto.moto_api import state_manager

    with moto.mock_aws():
        # Tasks stay RUNNING until stopped (moto otherwise advances them on every describe).
        state_manager.set_transition("ecs::task", {"progression": "manual", "times": 1_000_000})
        client = boto3.client("ecs", region_name=REGION)
        ec2 = boto3.client("ec2", region_name=REGION)
        client.create_cluster(clusterName=CLUSTER)
        instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]
        doc = json.dumps({"instanceId": instance["InstanceId"], "region": REGION})
        client.register_container_instance(cluster=CLUSTER, instanceIdentityDocument=doc)
        client.register_task_definition(
            family="sandbox",
            networkMode="bridge",
            containerDefinitions=[{"name": "sandbox", "image": "rollout-sandbox", "cpu": 256, "memory": 512}],
        )
        yield client
        state_manager.unset_transition("ecs::task")


def _config(**extra: Any) -> EcsSandboxConfig:
    base = {"cluster": CLUSTER, "task_definition": "sandbox", "launch_type": "EC2", "region": REGION}
    return EcsSandboxConfig(**{**base, "poll_s": 0.05, "start_timeout_s": 30, **extra})


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The providers built without a root put their owner records under the cache: the test's own."""
    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def containers(tmp_path):
    c = LocalContainers(tmp_path / "containers")
    yield c
    c.kill_all()


def _spec(run_id: str = "ecs-run", session: str = "s1") -> SandboxSpec:
    return SandboxSpec(run_id=run_id, session_id=session, ttl_s=600)


def _status(client: Any, arn: str) -> str:
    return client.describe_tasks(cluster=CLUSTER, tasks=[arn])["tasks"][0]["lastStatus"]


async def test_run_describe_exec_stop(ecs, containers):
    provider = EcsSandboxProvider(_config(), client=ecs, resolve=containers.resolve)
    sandbox = await provider.start(_spec())
    arn = sandbox.descriptor()["task_arn"]
    task = ecs.describe_tasks(cluster=CLUSTER, tasks=[arn], include=["TAGS"])["tasks"][0]
    assert task["lastStatus"] == "RUNNING" and task["startedBy"] == started_by("ecs-run")
    tags = {t["key"]: t["value"] for t in task["tags"]}
    assert tags[RUN_TAG] == "ecs-run" and int(tags[TTL_TAG]) > 0
    owner = Owner.decode(
        {k[len(OWNER_TAG_PREFIX) :]: v for k, v in tags.items() if k.startswith(OWNER_TAG_PREFIX)}
    )
    assert owner == Owner.current(hold(provider.root))  # the record under the root, this process's
    command = task["overrides"]["containerOverrides"][0]["command"]
    assert containers.agents[arn].token not in " ".join(command)  # the token only in the environment

    assert command[command.index("--isolation") :] == ["--isolation", "auto", "--run-as", "rollout-sandbox"]
    result = await sandbox.exec(["bash", "-c", "echo hello from $(pwd)"], timeout=30)
    assert result.exit_code == 0 and result.stdout_tail == f"hello from {containers.agents[arn].root}/work\n"
    if os.geteuid() == 0:  # the agent as root, as in the image: the command is the unprivileged user's
        token = containers.agents[arn].token
        res = await sandbox.exec(["bash", "-c", "id -un; cat /proc/[0-9]*/environ; true"], timeout=30)
        assert res.stdout_tail.split("\n")[0] == "rollout-sandbox" and token not in res.stdout_tail
        assert "Permission denied" in res.stderr_tail, res.stderr_tail
    await sandbox.write_file("x.txt", b"data")
    assert await sandbox.read_file("x.txt", 10) == b"data"

    await sandbox.stop()
    assert _status(ecs, arn) == "STOPPED"
    assert containers.agents[arn].proc.wait(15) == 0  # the agent was told to stop and left
    await sandbox.stop()  # idempotent


async def test_a_task_that_stopped_on_its_own_is_a_lost_sandbox(ecs, containers):
    provider = EcsSandboxProvider(_config(), client=ecs, resolve=containers.resolve)
    sandbox = await provider.start(_spec())
    arn = sandbox.descriptor()["task_arn"]
    # The spot capacity went away: ECS stops the task and the container with it.
    ecs.stop_task(cluster=CLUSTER, task=arn, reason="Your Spot Task was interrupted.")
    containers.agents[arn].proc.kill()
    with pytest.raises(SandboxLostError, match="Spot Task was interrupted"):
        await sandbox.exec(["true"], timeout=10)
    await sandbox.stop()  # already stopped: nothing to do, no error


def _stubbed(config: EcsSandboxConfig) -> tuple[Any, Stubber, list[dict[str, Any]]]:
    client = boto3.client("ecs", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(client)
    calls: list[dict[str, Any]] = []
    client.meta.events.register("provide-client-params.ecs.RunTask", lambda params, **_: calls.append(params))
    # The provider first makes sure the task definition has no task role.
    stubber.add_response("describe_task_definition", {"taskDefinition": {"family": "sandbox"}})
    return client, stubber, calls


async def test_a_task_definition_with_a_task_role_is_refused(ecs, containers):
    """Its credentials would be one request to 169.254.170.2 away from every command of the task."""
    role = "arn:aws:iam::123456789012:role/too-much"
    ecs.register_task_definition(
        family="with-role",
        taskRoleArn=role,
        networkMode="bridge",
        containerDefinitions=[{"name": "sandbox", "image": "rollout-sandbox", "cpu": 256, "memory": 512}],
    )
    provider = EcsSandboxProvider(
        _config(task_definition="with-role"), client=ecs, resolve=containers.resolve
    )
    with pytest.raises(SandboxStartError, match=f"has the task role {role}"):
        await provider.start(_spec())
    assert ecs.list_tasks(cluster=CLUSTER)["taskArns"] == []  # refused before any task ran
    off = EcsSandboxProvider(
        _config(task_definition="with-role", isolation="off"), client=ecs, resolve=containers.resolve
    )
    sandbox = await off.start(_spec())
    command = ecs.describe_tasks(cluster=CLUSTER, tasks=[sandbox.descriptor()["task_arn"]])["tasks"][0][
        "overrides"
    ]["containerOverrides"][0]["command"]
    assert "--isolation" not in command and "--run-as" not in command
    await sandbox.stop()


async def test_throttled_run_task_is_retried_with_the_same_client_token():
    cfg = _config(max_launch_attempts=4)
    client, stubber, calls = _stubbed(cfg)
    stubber.add_client_error("run_task", "ThrottlingException", "Rate exceeded", 400)
    stubber.add_client_error("run_task", "ThrottlingException", "Rate exceeded", 400)
    stubber.add_response(
        "run_task",
        {"tasks": [], "failures": [{"arn": "x", "reason": "RESOURCE:MEMORY", "detail": "no room"}]},
        {"cluster": CLUSTER, "taskDefinition": "sandbox", "count": 1, "startedBy": ANY, "clientToken": ANY,
         "tags": ANY, "overrides": ANY, "launchType": "EC2"},
    )  # fmt: skip
    with stubber, pytest.raises(SandboxStartError, match="no capacity: RESOURCE:MEMORY"):
        await EcsSandboxProvider(cfg, client=client).start(_spec())
    stubber.assert_no_pending_responses()
    assert len(calls) == 3 and len({c["clientToken"] for c in calls}) == 1
    assert all(c["count"] == 1 <= 10 for c in calls)


async def test_throttling_that_never_ends_is_a_start_failure():
    cfg = _config(max_launch_attempts=2)
    client, stubber, _calls = _stubbed(cfg)
    for _ in range(2):
        stubber.add_client_error("run_task", "ThrottlingException", "Rate exceeded", 400)
    with stubber, pytest.raises(SandboxStartError, match="ThrottlingException"):
        await EcsSandboxProvider(cfg, client=client).start(_spec())


async def test_a_refused_request_is_not_retried():
    client, stubber, calls = _stubbed(_config())
    stubber.add_client_error("run_task", "InvalidParameterException", "No such task definition", 400)
    with stubber, pytest.raises(SandboxStartError, match="InvalidParameterException"):
        await EcsSandboxProvider(_config(), client=client).start(_spec())
    assert len(calls) == 1


async def test_a_task_that_failed_to_start_is_a_start_failure():
    client, stubber, _calls = _stubbed(_config())
    arn = f"arn:aws:ecs:{REGION}:123456789012:task/{CLUSTER}/abc"
    stopped = {
        "taskArn": arn,
        "lastStatus": "STOPPED",
        "stopCode": "TaskFailedToStart",
        "stoppedReason": "CannotPullContainerError: pull access denied",
        "containers": [{"name": "sandbox", "reason": "CannotPullContainerError"}],
    }
    stubber.add_response(
        "run_task", {"tasks": [{"taskArn": arn, "lastStatus": "PROVISIONING"}], "failures": []}
    )
    stubber.add_response("describe_tasks", {"tasks": [stopped], "failures": []})
    stubber.add_response("describe_tasks", {"tasks": [stopped], "failures": []})  # cleanup: already stopped
    with stubber, pytest.raises(SandboxStartError, match="TaskFailedToStart: CannotPullContainerError"):
        await EcsSandboxProvider(_config(), client=client).start(_spec())
    stubber.assert_no_pending_responses()


# A stand-in worker: its owner as the provider tags a task with it, then it lives until its stdin closes.
OWNER = """
import json, sys
from pathlib import Path
from sandboxes.owner import Owner, hold
print(json.dumps(Owner.current(hold(Path(sys.argv[1]))).encode()), flush=True)
sys.stdin.read()
"""


def _owner_process(root: Path, *, own_pid_namespace: bool = False) -> tuple[subprocess.Popen[str], Owner]:
    proc = subprocess.Popen(
        python(OWNER, str(root), own_pid_namespace=own_pid_namespace),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    owner = Owner.decode(json.loads(proc.stdout.readline() if proc.stdout else "{}"))
    assert owner is not None and owner.record
    return proc, owner


def _dead_owner(root: Path) -> Owner:
    proc, owner = _owner_process(root)
    proc.communicate(timeout=60)  # its stdin closed: it exits, and the kernel frees its record's lock
    return owner


async def test_a_task_definition_per_image_registered_once_reused_and_deregistered_by_gc(ecs, containers):
    provider = EcsSandboxProvider(_config(), client=ecs, resolve=containers.resolve)
    calls: list[str] = []
    real_call = provider._call

    async def counted(op: str, **kwargs: Any) -> dict[str, Any]:
        calls.append(op)
        return await real_call(op, **kwargs)

    provider._call = counted  # type: ignore[method-assign]
    images = ["registry.example/task-a:1", "registry.example/task-b:2", "registry.example/task-a:1"]
    limits = {"cpus": 0.5, "memory_limit_mb": 768}
    specs = [
        SandboxSpec(run_id="img-run", session_id=f"s{i}", ttl_s=600, image=image, **limits)
        for i, image in enumerate(images)
    ]
    sandboxes = [await provider.start(spec) for spec in specs]
    try:
        seen = {}
        for sb, image in zip(sandboxes, images, strict=True):
            task = ecs.describe_tasks(cluster=CLUSTER, tasks=[sb.descriptor()["task_arn"]])["tasks"][0]
            definition = ecs.describe_task_definition(taskDefinition=task["taskDefinitionArn"])[
                "taskDefinition"
            ]
            assert definition["containerDefinitions"][0]["image"] == image
            assert (task["overrides"]["cpu"], task["overrides"]["memory"]) == ("512", "768")
            seen.setdefault(image, set()).add(task["taskDefinitionArn"])
        assert all(len(arns) == 1 for arns in seen.values()) and len(seen) == 2
        assert calls.count("register_task_definition") == 2  # one per distinct image, not per session
        # Another worker of the run finds them registered.
        other = EcsSandboxProvider(_config(), client=ecs, resolve=containers.resolve)
        assert await other.task_definition(specs[1]) in seen[images[1]]
    finally:
        for sb in sandboxes:
            await sb.stop()
    with pytest.raises(SandboxStartError, match="needs sandbox"):
        await provider.start(SandboxSpec(run_id="img-run", session_id="b", ttl_s=600, build_context="/ctx"))
    reaped = provider.reap("img-run", everything=True)
    assert sorted(a for a in reaped if ":task-definition/" in a) == sorted(
        a for arns in seen.values() for a in arns
    )
    active = ecs.list_task_definitions(status="ACTIVE")["taskDefinitionArns"]
    assert [a for a in active if "sandbox-rollout-" in a] == []
    assert any(a.endswith("/sandbox:1") for a in active)  # the configured one is the user's: kept


def _run_tagged(client: Any, run_id: str, owner: Owner) -> str:
    tags = [{"key": RUN_TAG, "value": run_id}, {"key": TTL_TAG, "value": "9999999999"}]
    tags += [{"key": OWNER_TAG_PREFIX + k, "value": v} for k, v in owner.encode().items()]
    answer = client.run_task(
        cluster=CLUSTER, taskDefinition="sandbox", launchType="EC2", startedBy=started_by(run_id), tags=tags
    )
    return answer["tasks"][0]["taskArn"]


def test_tasks_of_dead_owners_are_stopped_and_gc_stops_a_whole_run(ecs, tmp_path):
    provider = EcsSandboxProvider(_config(), root=tmp_path, client=ecs)
    orphan = _run_tagged(ecs, "r1", _dead_owner(tmp_path))
    alive = _run_tagged(ecs, "r1", Owner.current(hold(tmp_path)))
    other_run = _run_tagged(ecs, "r2", _dead_owner(tmp_path))
    assert provider.reap("r1") == [orphan]
    assert _status(ecs, orphan) == "STOPPED" and _status(ecs, alive) == "RUNNING"
    assert _status(ecs, other_run) == "RUNNING"
    assert provider.reap("r1") == []  # idempotent
    assert provider.reap("r1", everything=True) == [alive]
    assert provider.reap(None) == [other_run]  # any run: only what dead owners left


@pytest.mark.parametrize(
    "own_pid_namespace", [False, pytest.param(True, marks=needs_pid_namespace)], ids=["same", "owner-inside"]
)
def test_a_live_owner_is_told_by_its_records_lock_across_pid_namespaces(ecs, tmp_path, own_pid_namespace):
    """The owner in a PID namespace of its own (a run in a container) tags its task with the pid it sees,
    which names somebody else in ours; its record's lock says it lives, and once it is gone, that it died."""
    provider = EcsSandboxProvider(_config(), root=tmp_path, client=ecs)
    proc, owner = _owner_process(tmp_path, own_pid_namespace=own_pid_namespace)
    try:
        arn = _run_tagged(ecs, "r1", owner)
        assert provider.reap("r1") == []
        assert _status(ecs, arn) == "RUNNING"
    finally:
        proc.communicate(timeout=60)
    assert provider.reap("r1") == [arn]
    assert _status(ecs, arn) == "STOPPED"


def test_owners_this_machine_cannot_prove_dead_are_left_to_the_ttl(ecs, tmp_path):
    provider = EcsSandboxProvider(_config(), root=tmp_path, client=ecs)
    dead = _dead_owner(tmp_path)
    me = Owner.current()
    other_boot = f"{int(me.boot, 16) ^ 0xFFFFFFFF:08x}" if me.boot else "00000000"
    left = {
        # An older version's: a pid alone, gone from our /proc, which may not be the owner's PID namespace.
        "older": Owner(me.host, me.boot, dead.pid, dead.ticks),
        # Another machine's, even with a dead record under our root: its lock says nothing here.
        "elsewhere": Owner("elsewhere", other_boot, dead.pid, dead.ticks, dead.record),
        # A record we cannot see: this root may not be the filesystem the owner saw at its path.
        "missing": Owner(me.host, me.boot, dead.pid, dead.ticks, "0123456789abcdef"),
    }
    stopped = {
        "dead": dead,
        "this host, before its last boot": Owner(me.host, other_boot, dead.pid, dead.ticks),
    }
    arns = {why: _run_tagged(ecs, "r1", owner) for why, owner in (left | stopped).items()}
    assert sorted(provider.reap("r1")) == sorted(arns[why] for why in stopped)
    assert sorted(provider.reap("r1", now=10_000_000_000)) == sorted(arns[why] for why in left)


def test_tags_stay_within_ecs_limits_at_their_longest(tmp_path):
    provider = EcsSandboxProvider(_config(), root=tmp_path, client=object())
    longest = Owner("h" * 64, "abcdef01", 4_194_304, 2**63, "0123456789abcdef")  # Linux's longest host name
    tags = provider._run_task_args(_spec("r" * 300, "s" * 300), "token", longest)["tags"]
    assert len(tags) <= 50
    assert all(len(t["key"]) <= 128 and len(t["value"]) <= 256 for t in tags)
    decoded = {
        t["key"][len(OWNER_TAG_PREFIX) :]: t["value"] for t in tags if t["key"].startswith(OWNER_TAG_PREFIX)
    }
    assert Owner.decode(decoded) == longest


async def test_the_launch_bucket_allows_a_burst_then_the_rate():
    now = [0.0]
    bucket = TokenBucket(rate=20.0, burst=3, clock=lambda: now[0])
    for _ in range(3):
        await bucket.acquire()
    assert bucket.tokens < 1
    now[0] += 0.1  # two launches' worth at 20/s
    bucket._refill()
    assert bucket.tokens == pytest.approx(2.0)
    now[0] += 100
    bucket._refill()
    assert bucket.tokens == 3  # never more than the burst


def test_config_rejects_typos_and_needs_a_cluster():
    from executor.config import RunConfig

    with pytest.raises(ValueError, match="cluster"):
        RunConfig.model_validate({"tasks": "t", "sandbox": {"provider": "ecs", "task_definition": "x"}})
    with pytest.raises(ValueError, match="launch_typ"):
        RunConfig.model_validate(
            {
                "tasks": "t",
                "sandbox": {"provider": "ecs", "cluster": "c", "task_definition": "x", "launch_typ": 1},
            }
        )


async def test_the_shipped_task_definition_has_no_role_and_runs_the_agent_as_root(ecs):
    """Root, so that the agent can run the commands as another user; no task role, so that the
    credentials endpoint has nothing to give them. What the provider checks, it accepts."""
    shipped = json.loads((REPO / "cluster" / "ecs" / "task-definition.json").read_text())
    assert "taskRoleArn" not in shipped and shipped["containerDefinitions"][0]["user"] == "0"
    dockerfile = (REPO / "cluster" / "ecs" / "Dockerfile").read_text()
    assert "useradd" in dockerfile and '"--run-as", "rollout-sandbox"' in dockerfile
    assert all(f"sandboxes/{path.name}" in dockerfile for path in agent_files())  # what the agent imports
    keep = ("family", "containerDefinitions", "executionRoleArn", "cpu", "memory", "networkMode")
    ecs.register_task_definition(**{k: v for k, v in shipped.items() if k in keep})
    provider = EcsSandboxProvider(_config(task_definition=shipped["family"]), client=ecs)
    await provider._check_no_role(shipped["family"])
