"""The native init (sandboxes/native_init.c, .py): the command it starts is the same process, in every way
an agent could look at itself or use, as the one spawn.py's forked init starts from the same parameters
(its user and groups, capabilities, no_new_privs and seccomp filter, limits, OOM score, signals,
descriptors, namespaces, session, working directory); its failures say what failed, as that init's do;
and it is used only where no one but root could have written it. As root; the build needs a C compiler."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes import native_init, pidlimit, proctree, spawn, supervisor

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the init's steps need root"),
    pytest.mark.skipif(native_init.build() is None, reason="no C compiler builds the native init"),
]

# Everything the command can learn of its own process: sh is the command, $$ its pid. Its status read by
# sh itself (builtins, no fork): a child reading it could catch sh's mask of its fork, every signal blocked.
PROBE = (
    "while IFS= read -r l; do printf '%s\\n' \"$l\"; done < /proc/$$/status; "
    "cat /proc/$$/limits /proc/$$/oom_score_adj; readlink /proc/$$/cwd /proc/$$/ns/mnt "
    "/proc/$$/ns/ipc; ls /proc/$$/fd; env | sort; cut -d' ' -f6 /proc/$$/stat; echo $$; id; "
    "cat /proc/$$/cgroup >&2"
)
# Of /proc/PID/status, what an init decides (the rest is the pid's, its memory's, the scheduler's).
DECIDED = re.compile(r"^(Uid|Gid|Groups|NoNewPrivs|Seccomp|Seccomp_filters|Cap\w+|Sig(Blk|Ign)|Umask):")
SANDBOX_UID = 2_000_000_017  # no account needed: the init switches to the number


@pytest.fixture(params=["without a C library", "static glibc"])
def program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Each of the program's builds (native_init._BUILDS) as the native init: the one this machine runs
    and the one of machines without the first."""
    flags = native_init._BUILDS[0 if request.param == "without a C library" else 1]
    path = tmp_path_factory.mktemp("native") / "rollout-init"
    subprocess.run(["cc", *flags, "-o", str(path), native_init.SOURCE], check=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_init, "PROGRAM", str(path))
        yield str(path)


def _params(tmp_path: Path, argv: list[str], **extra: object) -> dict[str, object]:
    mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    ipc = os.open("/proc/self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    return {
        "argv": argv,
        "cwd": str(tmp_path),
        "view": [["root's view, built by the server"]],
        "view_fds": [mnt, ipc],
        "user": [SANDBOX_UID, SANDBOX_UID],
        "nofile_limit": 777,
        "memory_limit_bytes": 6 << 30,
        "file_size_limit_bytes": 3 << 30,
        **extra,
    }


def _run(p: dict[str, object], native: bool, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The command of ``p`` started by one init or the other, as the server starts a folded command;
    its exit code, stdout and stderr."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    env = env or {"PATH": "/usr/bin:/bin", "ROLLOUT_PROBE": "a=b c"}
    try:
        if native:
            pid = native_init.start(p, env, stdin, out_w, err_w)
        else:

            def prepare() -> None:  # the folded command's: its limits, then namespaces.ServerInit.enter
                supervisor.limit_process(p)
                proctree.prctl(proctree.PR_CAPBSET_DROP, proctree.CAP_SYS_ADMIN)

            child, status_r = spawn._start_init(p, env, stdin, out_w, err_w, prepare)
            os.close(status_r)
            pid = child.pid
    finally:
        for fd in (out_w, err_w, stdin):
            os.close(fd)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        stdout, stderr = out.read().decode(), err.read().decode()
    _pid, status = os.waitpid(pid, 0)
    for fd in p.get("view_fds") or ():
        os.close(int(fd))
    return os.waitstatus_to_exitcode(status), stdout, stderr


# The C library's own two signals (32, 33): the forked init cannot set them (glibc's sigaction refuses),
# so it passes on what its parent had; the native init sets every signal, so its command has none ignored.
_LIBC_SIGNALS = (1 << 31) | (1 << 32)


def _decided(stdout: str, pid_line: str) -> list[str]:
    lines = stdout.splitlines()
    return [
        f"SigIgn:\t{int(line.split()[1], 16) & ~_LIBC_SIGNALS:016x}"
        if line.startswith("SigIgn:")
        else line.replace(pid_line, "PID")
        for line in lines
        if DECIDED.match(line) or not re.match(r"^[A-Za-z_]+:\s", line)  # not a status line: all of it
    ]


@contextlib.contextmanager
def _cancel_signal_ignored() -> Iterator[None]:
    """Signal 32 (glibc's SIGCANCEL) ignored in this process meanwhile, as a whole suite's process once
    had it: by the kernel's own call, which glibc's sigaction would refuse. x86-64 only (its numbers and
    its sigaction layout); elsewhere, nothing."""
    if os.uname().machine != "x86_64":
        yield
        return
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    ignore, old = (ctypes.c_ulong * 4)(1, 0, 0, 0), (ctypes.c_ulong * 4)()  # SIG_IGN, no flags, no mask
    assert syscall(13, 32, ignore, old, 8) == 0  # rt_sigaction
    try:
        yield
    finally:
        syscall(13, 32, old, None, 8)


def test_the_command_is_the_same_process_under_either_init(tmp_path: Path, program: str) -> None:
    group = pidlimit.make(f"native-{os.getpid()}", 1 << 30, pidlimit.MEMORY)
    extra = {"memory_procs": group, "memory_max": 1 << 30} if group else {}
    os.chmod(tmp_path, 0o755)
    # A signal the parent blocks, and SIGPIPE, which Python ignores: a command gets neither.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        seen = {}
        for native in (False, True):
            with _cancel_signal_ignored():
                code, stdout, _stderr = _run(_params(tmp_path, ["sh", "-c", PROBE], **extra), native)
            assert code == 0, stdout
            lines = stdout.splitlines()
            session, pid = lines[-3], lines[-2]
            assert session == pid  # a session of its own, which it leads
            seen[native] = _decided(stdout, pid)
            if native:
                assert re.search(r"^SigIgn:\t0+$", stdout, re.M), stdout  # not even the C library's two
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        if group:
            pidlimit.remove(group)
    assert seen[True] == seen[False]
    decided = "\n".join(seen[True])
    assert f"Uid:\t{SANDBOX_UID}\t{SANDBOX_UID}\t{SANDBOX_UID}\t{SANDBOX_UID}" in decided
    assert "NoNewPrivs:\t1" in decided and "Seccomp:\t2" in decided
    assert re.search(r"SigIgn:\t0+\n", decided + "\n") and re.search(r"SigBlk:\t0+\n", decided + "\n")
    assert re.search(r"Max open files\s+777\s+777", decided)
    assert re.search(r"Max core file size\s+0\s+0", decided)
    assert re.search(r"Max file size\s+3221225472\s+3221225472", decided)
    assert "\n0\n1\n2\n" in f"\n{decided}\n"  # stdio alone (sh holds none of its own here)
    assert "\nROLLOUT_PROBE=a=b c\n" in f"\n{decided}\n"  # the command's environment, as given
    if group:
        assert "\n1000\n" in f"\n{decided}\n"  # the memory cap's OOM killer takes the command first


def test_a_step_that_fails_says_which_and_a_missing_command_exits_127(tmp_path: Path, program: str) -> None:
    os.chmod(tmp_path, 0o755)
    # A namespace descriptor that is no namespace: the init stops before the command, exit 1.
    p = _params(tmp_path, ["true"])
    os.close(int(p["view_fds"][0]))  # type: ignore[index]
    p["view_fds"] = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), p["view_fds"][1]]  # type: ignore[index]
    code, _out, err = _run(p, native=True)
    assert code == 1 and err.startswith("sandbox isolation: the view's mount namespace: "), err
    for native in (True, False):
        code, _out, err = _run(_params(tmp_path, ["no-such-command-here"]), native)
        assert code == 127 and "cannot run 'no-such-command-here': No such file or directory" in err, err
        code, _out, err = _run(_params(tmp_path, ["sh"], cwd=str(tmp_path / "gone")), native)
        assert code == 127 and "cannot run 'sh'" in err, err
    (tmp_path / "not-runnable").write_text("#!/bin/sh\n")
    for native in (True, False):
        code, _out, err = _run(_params(tmp_path, [str(tmp_path / "not-runnable")]), native)
        assert code == 126 and "Permission denied" in err, err


# What a command sees of its view: its mounts (all but their numbers and peer groups) and the modes and
# types of what the view made itself.
VIEW_PROBE = (
    "while read -r _id _parent _dev root at opts rest; do "
    'printf "%s %s %s %s\\n" "$root" "$at" "$opts" "${rest#*- }"; done < /proc/self/mountinfo; echo; '
    "stat -c '%a %F %h %n' / /dev /dev/* /dev/pts /tmp /dev/shm /bin /etc/shadow /etc/passwd "
    '"$HIDDEN_DIR" "$HIDDEN_DIR/.." "$WORK" "$WORK/.."; ls -a "$HIDDEN_DIR" "$WORK"; '
    'echo x > /tmp/t && echo x > "$WORK/w" && rm "$WORK/w" && ! echo x > /etc/passwd 2>/dev/null '
    "&& echo writes as planned"
)


def _seen_in_view(view: tuple[int, int] | None, tmp_path: Path, env: dict[str, str]) -> str:
    assert view is not None, "no view was built"
    p = {"argv": ["sh", "-c", VIEW_PROBE], "cwd": "/", "view": [["built"]], "view_fds": list(view)}
    p["nofile_limit"] = 1024
    code, out, err = _run(p, native=True, env=env)
    assert code == 0, err
    # The mounts in their order of creation, which differs (a server's /proc is a clone made before the
    # view's own mounts, a forked builder mounts one of its own): sorted, a procfs's source left out.
    mounts, _, rest = out.partition("\n\n")
    lines = sorted(re.sub(r" proc \S+ ", " proc - ", line) for line in mounts.splitlines())
    return "\n".join(lines) + "\n\n" + rest


def test_the_view_the_program_builds_is_the_one_fsview_builds(tmp_path: Path, program: str) -> None:
    """The native init's view mode against fsview.apply (the reference, in a forked child as a server
    without the program builds it): the same mounts with the same options, the same mount points made
    with the same modes, a file and a directory hidden, binds read-only and writable, the devices."""
    from sandboxes import fsview, supervisor_server, zygote

    os.chmod(tmp_path, 0o755)
    shown = tmp_path / "shown"
    (shown / "secret").mkdir(parents=True)
    (shown / "secret" / "key").write_text("k")
    (shown / "plain.txt").write_text("p")
    (tmp_path / "work").mkdir()
    (tmp_path / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    steps = fsview.plan(
        [str(shown / "secret"), str(shown / "plain.txt")],
        ["/tmp", "/dev/shm"],
        [str(shown)],
        [str(tmp_path / "work")],
        {"/etc/passwd": str(tmp_path / "passwd")},
    )
    assert {step[0] for step in steps} >= {fsview.LINK, fsview.HIDE, fsview.RO, fsview.RW, fsview.DEV}
    env = {"PATH": "/usr/bin:/bin", "HIDDEN_DIR": str(shown / "secret"), "WORK": str(tmp_path / "work")}
    base = zygote._base_mounts()
    assert base is not None
    proc = fsview.detached_proc()
    try:
        native = supervisor_server._build_view_natively(steps, base, fsview.clone_mount(proc))
        seen_native = _seen_in_view(native, tmp_path, env)
        reference = supervisor_server._build_view(steps, base, ())
        seen_reference = _seen_in_view(reference, tmp_path, env)
    finally:
        os.close(base)
        os.close(proc)
    assert seen_native == seen_reference
    assert "writes as planned" in seen_native and " tmpfs " in seen_native and "devpts" in seen_native
    assert "key" not in seen_native.split("writes as planned")[0].split(str(shown / "secret") + ":")[-1]


def test_a_view_step_that_fails_leaves_the_server_to_build_it(tmp_path: Path, program: str) -> None:
    """A source that cannot be bound (it went between the plan and the build): the program says which
    and exits before it says the view is built; the server then builds it itself, and meets the reason."""
    from sandboxes import fsview, supervisor_server, zygote

    (tmp_path / "gone").mkdir()
    steps = fsview.plan([], ["/tmp"], [str(tmp_path / "gone")], [])
    (tmp_path / "gone").rmdir()
    base = zygote._base_mounts()
    assert base is not None
    proc = fsview.detached_proc()
    err_r, err_w = os.pipe()
    saved = os.dup(2)
    os.dup2(err_w, 2)
    try:
        view = supervisor_server._build_view_natively(steps, base, fsview.clone_mount(proc))
    finally:
        os.dup2(saved, 2)
        for fd in (saved, err_w, base, proc):
            os.close(fd)
    with os.fdopen(err_r, "rb") as err:
        said = err.read().decode()
    assert view is None
    assert said == f"sandbox view: open_tree {tmp_path / 'gone'}: No such file or directory\n", said


def test_only_a_build_no_one_else_could_write_is_used(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    build = tmp_path / "build"
    build.mkdir()
    program = build / "rollout-init-x"
    shutil.copy(native_init.build() or "", program)
    os.chmod(program, 0o755)
    assert native_init._ours(str(program))
    for mode in (0o775, 0o757):  # writable by its group, by anyone
        os.chmod(program, mode)
        assert not native_init._ours(str(program))
        os.chmod(program, 0o755)
        os.chmod(build, mode)
        assert not native_init._ours(str(program))
        os.chmod(build, 0o755)
    os.chown(program, SANDBOX_UID, -1)
    assert not native_init._ours(str(program))
    os.chown(program, 0, -1)
    (build / "link").symlink_to(program)
    assert not native_init._ours(str(build / "link"))
    os.chmod(build, 0o1777)  # sticky: its entries are their owners' alone
    assert native_init._ours(str(program))


def test_a_build_is_named_by_its_source_and_a_machine_without_a_compiler_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src" / "native_init.c"
    source.parent.mkdir()
    shutil.copy(native_init.SOURCE, source)
    monkeypatch.setattr(native_init, "SOURCE", str(source))
    monkeypatch.setattr(native_init, "_HERE", str(source.parent))
    first = native_init.expected_path()
    with source.open("a") as f:
        f.write("/* changed */\n")
    assert native_init.expected_path() != first  # an older build is never run for a changed source
    monkeypatch.setattr(native_init, "_COMPILERS", ("no-such-compiler-here",))
    assert native_init.build() is None
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").iterdir())
    monkeypatch.undo()
    monkeypatch.setattr(native_init, "SOURCE", str(source))
    monkeypatch.setattr(native_init, "_HERE", str(source.parent))
    built = native_init.build()
    assert built == native_init.expected_path() and built is not None
    assert stat.S_IMODE(os.stat(built).st_mode) == 0o755 and native_init._ours(built)
    assert [p.name for p in (tmp_path / "build").iterdir()] == [Path(built).name]  # no partial left
