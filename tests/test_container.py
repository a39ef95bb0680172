"""The container provider against real podman: commands under the supervisor inside a container of the
task's image, files in and out, a container removed from outside read as lost, the reaper (a SIGKILLed
owner's containers removed, a live owner's kept), the API key never inside, and images: a missing one, one
without python, a Dockerfile built once for concurrent starts, a Dockerfile that fails."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandboxes import container
from sandboxes.base import SandboxError, SandboxLostError, SandboxSpec, SandboxStartError
from sandboxes.container import (
    ContainerSandboxConfig,
    ContainerSandboxProvider,
    list_containers,
    reap_containers,
)
from sandboxes.testing.images import MARKER_PATH, MARKER_TEXT, TestImages, podman_usable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(podman_usable() is not None, reason=str(podman_usable())),
]

REPO = Path(__file__).parents[1]
# What this machine's podman needs as root (issue 16): crun refuses hybrid cgroups, rlimits cannot rise.
HOST_ARGS = {"runtime": "runc", "ulimits": ["nofile=1024:1024", "nproc=1024:1024"]}


@pytest.fixture
def gateway_socket(tmp_path: Path) -> Iterator[str]:
    """A listening Unix socket standing in for the gateway's: the provider mounts it in."""
    path = str(tmp_path / "gw.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        yield path


# The build log is the machine's: it outlives pytest's numbered directories, whose numbers start again
# once they are cleared, so a test's context path may be an earlier session's too. Only this session's
# builds count.
_SESSION_START = int(time.time())


def builds_of(context: Path) -> list[str]:
    """The lines of the cache's build log for ``context`` since this session began: one per build of it."""
    from harnesses.install import default_cache_root

    log = default_cache_root() / "images" / "builds.log"
    lines = [line.split() for line in log.read_text().splitlines()]
    ours = [f for f in lines if f[3:4] == [str(context)] and f[0].isdigit()]
    return [" ".join(f) for f in ours if int(f[0]) >= _SESSION_START]


def remove_built(context: Path) -> None:
    """Remove the images built from a test's own context, so that test runs do not pile them up."""
    tags = [line.split()[2] for line in builds_of(context)]
    subprocess.run(["podman", "rmi", "-f", *tags], capture_output=True, timeout=120, check=False)


def config(tmp_path: Path, image: str, **extra: object) -> ContainerSandboxConfig:
    return ContainerSandboxConfig(image=image, root=str(tmp_path / "root"), **HOST_ARGS, **extra)


@pytest.fixture
async def provider(
    tmp_path: Path, test_images: TestImages, gateway_socket: str
) -> AsyncIterator[ContainerSandboxProvider]:
    provider = config(tmp_path, test_images.base).build(Path(tmp_path / "root"), (4999, gateway_socket))
    yield provider
    await provider.aclose()  # stopped sandboxes' containers are removed off their sessions' path


def spec(**extra: object) -> SandboxSpec:
    return SandboxSpec(run_id="ctr-test", session_id=uuid.uuid4().hex[:12], ttl_s=300, **extra)


def exists(container: str) -> bool:
    return subprocess.run(["podman", "container", "exists", container], timeout=60).returncode == 0


@pytest.fixture
async def sandbox(provider: ContainerSandboxProvider) -> AsyncIterator:
    sb = await provider.start(spec())
    try:
        yield sb
    finally:
        await sb.stop()


async def test_commands_files_and_stop(sandbox, provider, test_images):
    res = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (res.exit_code, res.signal, res.stdout_tail, res.stderr_tail) == (3, None, "out\n", "err\n")
    res = await sandbox.exec(["sh", "-c", "kill -9 $$"], timeout=30)
    assert (res.exit_code, res.signal) == (None, signal.SIGKILL)
    # The deadline ends the whole tree, a grandchild in the background included.
    res = await sandbox.exec(["sh", "-c", "sleep 300 & sleep 300"], timeout=1)
    assert res.timed_out
    ps = await sandbox.exec(["sh", "-c", "cat /proc/[0-9]*/comm"], timeout=30)
    # The agent, its supervisor server, this command's supervisor and sh: no sleep left.
    assert "sh" in ps.stdout_tail.split() and "sleep" not in ps.stdout_tail.split(), ps.stdout_tail

    await sandbox.write_file("sub/a.txt", b"xyz")
    assert await sandbox.read_file(f"{sandbox.workdir}/sub/a.txt", 10) == b"xyz"
    res = await sandbox.exec(["cat", "sub/a.txt"], timeout=30)
    assert res.stdout_tail == "xyz"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("missing", 10)
    # The image's own files: the base has no marker.
    assert (await sandbox.exec(["test", "-e", MARKER_PATH], timeout=30)).exit_code == 1

    container = sandbox.descriptor()["container"]
    assert exists(container)
    await sandbox.stop()
    # Its removal runs off the session's path, and is awaited by the provider's close.
    await provider.finish_removals()
    assert not exists(container)
    assert not (provider.root / "ctr-test" / sandbox.spec.session_id).exists()


async def test_network_is_the_gateway_only(sandbox, gateway_socket):
    probe = textwrap.dedent("""
        import socket
        socket.create_connection(("127.0.0.1", 4999), timeout=5).close()
        print("gateway")
        try:
            socket.create_connection(("1.1.1.1", 80), timeout=2)
            print("internet")
        except OSError:
            print("no internet")
    """)
    res = await sandbox.exec(["python3", "-c", probe], timeout=30)
    assert res.stdout_tail.split() == ["gateway", "no", "internet"], res.stderr_tail


async def test_a_spare_serves_the_next_start_and_goes_when_the_run_is_over(provider):
    """A stopped sandbox leaves a spare like it started (off its session's path); the next start of the
    same kind takes it, a fresh container, not the stopped one; the run's end removes the spares."""

    def ours() -> dict[str, str]:
        return {
            name: labels["rollout.session_id"]
            for name, labels in list_containers("podman", "ctr-test")
            if labels["rollout.root"] == str(provider.root)
        }

    first = await provider.start(spec())
    await first.stop()
    await provider.settle()  # its removal done, the spare started
    spares = [name for name, session in ours().items() if session.startswith("spare-")]
    assert len(spares) == 1 and first.id not in ours()
    second = await provider.start(spec())
    try:
        assert second.id == spares[0]
        assert second.spec.session_id != ours()[second.id]  # the session's own, not the spare's label
        assert (
            await second.exec(["sh", "-c", "ls -A /rollout/work | wc -l"], timeout=30)
        ).stdout_tail == "0\n"
    finally:
        await second.stop()
    await provider.finish_removals()  # the run is over: the spare its stop began goes too
    assert ours() == {}


async def test_a_stop_that_ends_after_the_run_is_over_leaves_no_spare(provider):
    """A sandbox whose stop was still under way when its run ended (the worker's release) starts no spare:
    no one would take it, nor remove it before the reaper. The next start wants spares again."""
    first = await provider.start(spec())
    await provider.finish_removals()  # the run is over, this stop still to come
    await first.stop()
    await provider.settle()
    assert [labels for _, labels in list_containers("podman", "ctr-test")
            if labels["rollout.root"] == str(provider.root)] == []  # fmt: skip
    second = await provider.start(spec())
    await second.stop()
    await provider.settle()
    assert [labels["rollout.session_id"][:6] for _, labels in list_containers("podman", "ctr-test")
            if labels["rollout.root"] == str(provider.root)] == ["spare-"]  # fmt: skip


async def test_workspace_carried_on_the_host_between_containers(sandbox, provider):
    """The grading sandbox gets the agent's workspace copied on the worker's host, no command run in
    either container: files and links as links, never followed; a workspace the agent replaced by a
    link (root in its container, it can) carries nothing and says so, and is no failure."""
    from executor.grading import carry_workspace

    checker = await provider.start(spec())
    try:
        assert sandbox.host_workdir is not None and checker.host_workdir is not None
        await checker.write_file("laid-out.txt", b"the task's")
        res = await sandbox.exec(
            ["sh", "-c", "mkdir -p sub && echo hi > sub/a.txt && ln -s /etc/passwd out && mkfifo fifo"],
            timeout=30,
        )
        assert res.exit_code == 0, res.stderr_tail
        carried = await carry_workspace(sandbox, checker)
        assert carried.skipped == 1 and "fifo" in (carried.gap() or "")
        listing = await checker.exec(["sh", "-c", "ls -A; cat sub/a.txt; readlink out"], timeout=30)
        assert listing.stdout_tail.split() == ["out", "sub", "hi", "/etc/passwd"], listing.stdout_tail

        moved = await sandbox.exec(
            ["sh", "-c", "cd / && rm -rf /rollout/work && ln -s /etc /rollout/work"], timeout=30
        )
        assert moved.exit_code == 0, moved.stderr_tail
        carried = await carry_workspace(sandbox, checker)
        assert "the workspace is no directory" in (carried.gap() or "")
        assert (await checker.exec(["sh", "-c", "ls -A | wc -l"], timeout=30)).stdout_tail.strip() == "0"
    finally:
        await checker.stop()


async def test_container_removed_from_outside_is_lost(sandbox, provider):
    started = provider.root / "ctr-test" / sandbox.spec.session_id / "tmp" / "started"
    running = asyncio.ensure_future(
        sandbox.exec(["sh", "-c", "touch /rollout/tmp/started; sleep 60"], timeout=120)
    )
    for _ in range(600):  # bounded: the command is running once its file is there
        if started.exists():
            break
        await asyncio.sleep(0.05)
    container = sandbox.descriptor()["container"]
    subprocess.run(["podman", "rm", "-f", "-t", "0", container], timeout=60, check=True)
    with pytest.raises(SandboxLostError):
        await running


async def test_api_key_never_inside(tmp_path, test_images, gateway_socket, monkeypatch):
    secret = f"sk-secret-{uuid.uuid4().hex}"
    since = time.time()
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    provider = config(tmp_path, test_images.base).build(tmp_path / "root", (4999, gateway_socket))
    sb = await provider.start(spec())
    try:
        res = await sandbox_search(sb, secret, since)
        assert res.exit_code == 0 and res.stdout_tail == "", (res.stdout_tail, res.stderr_tail)
        assert int(res.stderr_tail.split()[-1]) > 0, res.stderr_tail  # what the sandbox wrote was read
        inspect = subprocess.run(
            ["podman", "inspect", sb.descriptor()["container"]], capture_output=True, text=True, timeout=60
        )
        assert inspect.returncode == 0 and secret not in inspect.stdout
    finally:
        await sb.stop()
        await provider.aclose()


_SEARCH = """
import os, sys
secret = (sys.argv[1] + sys.argv[2]).encode()  # given in halves: this command's own argv must not match
since = float(sys.argv[3])
me = str(os.getpid())
read = 0
for pid in os.listdir("/proc"):
    for name in ("environ", "cmdline"):
        try:
            if pid.isdigit() and pid != me and secret in open(f"/proc/{pid}/{name}", "rb").read():
                print(f"/proc/{pid}/{name}")
        except OSError:
            pass
for top, dirs, files in os.walk("/"):
    if top == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
    for name in files:
        path = os.path.join(top, name)
        try:
            # The secret is new to this test: a file not changed since it began cannot hold it (a
            # write or a utime sets ctime), and reading the image's and the harness cache's GBs would
            # take minutes when they are not in the page cache.
            if os.path.islink(path) or not os.path.isfile(path) or os.stat(path).st_ctime < since:
                continue
            read += 1
            if secret in open(path, "rb").read():
                print(path)
        except OSError:
            pass
print(f"read {read}", file=sys.stderr)
"""


async def sandbox_search(sb, secret: str, since: float):
    """Where ``secret`` (made at ``since``) is inside the sandbox: every process's environment and command
    line (what ps shows), and every file but /proc's, /sys's and /dev's changed since then."""
    half = len(secret) // 2
    return await sb.exec(
        ["python3", "-c", _SEARCH, secret[:half], secret[half:], f"{since - 1:.3f}"], timeout=120
    )


def _owner_script(root: Path, image: str, gateway_socket: str) -> str:
    return textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from sandboxes.base import SandboxSpec
        from sandboxes.container import ContainerSandboxConfig

        async def main():
            cfg = ContainerSandboxConfig(image={image!r}, root={str(root)!r}, **{HOST_ARGS!r})
            provider = cfg.build(Path({str(root)!r}), (4999, {gateway_socket!r}))
            sb = await provider.start(SandboxSpec(run_id="ctr-owner", session_id="s1", ttl_s=600))
            print(sb.descriptor()["container"], flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """)


async def test_sigkilled_owner_is_reaped_live_owner_kept(tmp_path, test_images, gateway_socket, sandbox):
    root = tmp_path / ("root-" + "r" * 60)  # its agents' sockets are reached through short links
    child = subprocess.Popen(
        [sys.executable, "-c", _owner_script(root, test_images.base, gateway_socket)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        orphan = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 120)
        orphan = orphan.strip()
        assert orphan and exists(orphan)
        assert os.path.lexists(container._LINK_DIR / orphan)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    mine = sandbox.descriptor()["container"]
    reaped = await asyncio.to_thread(reap_containers, "podman", root)
    assert reaped == [orphan]
    assert not exists(orphan) and exists(mine)
    assert not os.path.lexists(container._LINK_DIR / orphan)
    assert not (root / "ctr-owner" / "s1").exists()
    assert await asyncio.to_thread(reap_containers, "podman", root) == []
    # gc --all of a run ends even a live owner's.
    assert await asyncio.to_thread(reap_containers, "podman", root, "ctr-test", everything=True)
    assert not exists(mine)


def _empty_image(tmp_path: Path) -> str:
    """An image of one empty directory: no shell, no C library, no loader."""
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w") as tar:
        info = tarfile.TarInfo("etc")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    tag = "localhost/rollout-test-empty:1"
    if subprocess.run(["podman", "image", "exists", tag], timeout=60).returncode != 0:
        subprocess.run(
            ["podman", "import", "-q", str(empty), tag], capture_output=True, timeout=60, check=True
        )
    return tag


async def test_missing_image_and_the_image_python_option(tmp_path, provider, gateway_socket):
    with pytest.raises(SandboxStartError) as missing:
        await provider.start(spec(image="localhost/rollout-no-such-image:1"))
    assert "localhost/rollout-no-such-image:1" in str(missing.value) and "\n" not in str(missing.value)

    # Asked to use the image's own python, an image without one fails at start in one line.
    tag = _empty_image(tmp_path)
    own = config(tmp_path, tag, python="python3").build(tmp_path / "root", (4999, gateway_socket))
    with pytest.raises(SandboxStartError) as nopython:
        await own.start(spec(image=tag))
    assert f"image {tag!r} cannot host the sandbox: no python3" in str(nopython.value)
    assert not [c for c, labels in list_containers("podman", "ctr-test")]


@pytest.mark.parametrize("which", ["bare", "busybox", "empty"])
async def test_images_without_python_host_the_agent(tmp_path, provider, test_images, which):
    """The worker's python, its loader and libraries carried in: the agent runs in a Debian minbase
    without python3, in a static busybox alone, and in an image of one empty directory."""
    image = _empty_image(tmp_path) if which == "empty" else getattr(test_images, which)
    sb = await provider.start(spec(image=image))
    try:
        assert (await sb.exec(["python3", "-V"], timeout=30)).exit_code == 127  # the image has none
        res = await sb.exec([*sb.python_argv, "-c", "import sys; print(sys.version_info[:2])"], timeout=30)
        assert res.exit_code == 0 and res.stdout_tail.strip() == str(sys.version_info[:2]), res.stderr_tail
        await sb.write_file("a/b.txt", b"xyz")
        assert await sb.read_file(f"{sb.workdir}/a/b.txt", 10) == b"xyz"
        if which != "empty":
            # A command's environment holds nothing of the carried runtime: its own libraries win.
            res = await sb.exec(["sh", "-c", "cat a/b.txt; echo; env | grep -c LD_ || true"], timeout=30)
            assert res.stdout_tail.split() == ["xyz", "0"], res.stderr_tail
            res = await sb.exec(["sh", "-c", "sleep 300 & sleep 300"], timeout=1)
            assert res.timed_out
    finally:
        await sb.stop()


async def test_dockerfile_built_once_for_concurrent_starts(tmp_path, provider, test_images):
    context = tmp_path / "ctx"
    context.mkdir()
    nonce = uuid.uuid4().hex
    (context / "Dockerfile").write_text(f"FROM {test_images.base}\nRUN echo {nonce} > /etc/nonce\n")
    sandboxes = await asyncio.gather(*(provider.start(spec(build_context=str(context))) for _ in range(3)))
    try:
        for sb in sandboxes:
            assert (await sb.exec(["cat", "/etc/nonce"], timeout=30)).stdout_tail.strip() == nonce
    finally:
        await asyncio.gather(*(sb.stop() for sb in sandboxes))
    assert len(builds_of(context)) == 1
    remove_built(context)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "Dockerfile").write_text(f"FROM {test_images.base}\nRUN echo failing-step && exit 7\n")
    for _ in range(2):  # the second is answered from the first's failure
        with pytest.raises(SandboxStartError) as failed:
            await provider.start(spec(build_context=str(broken)))
        assert f"build of {broken} failed" in str(failed.value) and "\n" not in str(failed.value)


async def test_task_image_and_limits(tmp_path, provider, test_images):
    sb = await provider.start(spec(image=test_images.marker, cpus=1, memory_limit_mb=256))
    try:
        assert (await sb.exec(["cat", MARKER_PATH], timeout=30)).stdout_tail.strip() == MARKER_TEXT
        inspect = subprocess.run(
            ["podman", "inspect", sb.descriptor()["container"]], capture_output=True, text=True, timeout=60
        )
        host = json.loads(inspect.stdout)[0]["HostConfig"]
        assert host["Memory"] == 256 * 1024 * 1024 and host["NanoCpus"] == 10**9
    finally:
        await sb.stop()


async def test_a_command_the_containers_memory_cap_killed_says_so(provider, tmp_path, monkeypatch):
    """As a local sandbox's: the result names the cap and its kills (``limit``, ``oom_kills``), which the
    row's message carries (harnesses/classify.py), not a signal with no cause; the sandbox serves on. And
    nothing of it lands in the worker's working directory (podman's monitor writes an `oom` file where
    it was started)."""
    here = tmp_path / "worker-cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    sb = await provider.start(spec(memory_limit_mb=128))
    try:
        hog = await sb.exec(["python3", "-c", "b = b'x' * (512 * 2**20); print('no cap')"], timeout=60)
        assert (hog.signal, hog.stdout_tail) == (signal.SIGKILL, ""), hog
        assert hog.oom_kills >= 1
        assert (
            hog.limit
            == f"the sandbox's memory cap of 128 MiB killed {hog.oom_kills} of its processes (out of memory)"
        )
        fine = await sb.exec(["sh", "-c", "echo fine; exit 3"], timeout=60)
        assert (fine.exit_code, fine.oom_kills, fine.limit) == (3, 0, None)
        assert list(here.iterdir()) == []
    finally:
        await sb.stop()


async def test_an_image_that_cannot_host_the_harness_fails_in_one_line(
    tmp_path, provider, test_images, codex_installed, pi_installed
):
    from harnesses.codex import native_binary
    from harnesses.pi import node_for

    node = str(node_for(pi_installed))
    context = tmp_path / "no-libstdcxx"
    context.mkdir()
    # Node (Pi's runtime) needs libstdc++; Codex's binary is static.
    (context / "Dockerfile").write_text(
        f"FROM {test_images.base}\nRUN rm -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6*\n"
    )
    sb = await provider.start(spec(build_context=str(context)))
    try:
        await sb.check_runs(str(native_binary(codex_installed)), "the codex harness")
        with pytest.raises(SandboxError) as failed:
            await sb.check_runs(node, "the pi harness")
        message = str(failed.value)
        assert message.startswith(f"image {sb.image!r} cannot run the pi harness: {node}: ")
        assert "libstdc++.so.6" in message and "\n" not in message
    finally:
        await sb.stop()
    sb = await provider.start(spec())
    try:
        await sb.check_runs(node, "the pi harness")  # the base image has it
    finally:
        await sb.stop()


async def test_engine_limits_picked_or_named_in_one_line(tmp_path, test_images, gateway_socket):
    """No ulimits configured: the provider finds limits the engine can apply (as root here, podman's own
    ask more than runc may set). Ones it cannot apply: one line naming the setting and the fix."""
    picked = ContainerSandboxConfig(image=test_images.busybox, root=str(tmp_path / "root"), runtime="runc")
    provider = picked.build(tmp_path / "root", (4999, gateway_socket))
    sb = await provider.start(spec())
    try:
        assert (await sb.exec(["sh", "-c", "ulimit -n"], timeout=30)).exit_code == 0
    finally:
        await sb.stop()
        await provider.aclose()
    too_high = ContainerSandboxConfig(
        image=test_images.busybox,
        root=str(tmp_path / "root"),
        runtime="runc",
        ulimits=["nproc=4000000:4000000"],
    )
    with pytest.raises(SandboxStartError) as failed:
        await too_high.build(tmp_path / "root", (4999, gateway_socket)).start(spec())
    message = str(failed.value)
    assert message.startswith("podman cannot apply its resource limits here: set sandbox.ulimits")
    assert "\n" not in message
