"""How a supervisor starts its command: posix_spawn (or Popen, where a limit needs a hook before exec),
or, where the sandbox has namespaces per command (a loopback-only network, root's filesystem view: the
sandbox's, which its server built once, or one of the command's own), a process cap or the sandbox user,
by a fork into an init that makes or joins them and then becomes the command (or
forks it, and reports its wait status on a pipe). supervisor.py, which owns the command from there on,
is this module's only user.

Standard library only, like supervisor.py: it ships beside it (sandboxes/remote.py's AGENT_IMPORTS).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

# Our directory: netns.py, fsview.py, pidlimit.py and seccomp.py are our siblings, which a command's init
# imports by name (``_init``). Found once, at import: its abspath in each init cost ~35 pages copied.
_HERE = os.path.dirname(os.path.abspath(__file__))
if __package__:
    from sandboxes import nest, proctree
else:  # imported by supervisor.py run by path: -I leaves our directory off sys.path
    sys.path.insert(0, _HERE)
    import nest
    import proctree

# No `typing` or `subprocess` at start-up (see supervisor.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from typing import Any, NoReturn

STOP_SIGNALS = proctree.PASSED_SIGNALS  # passed on to the command by its init, as by any stand-in

# ---------------------------------------------------------------------------------------------------------
# Namespaces per command (a loopback-only network, root's filesystem view) and the sandbox user: the
# supervisor forks an init into them, which runs the gateway forwarder and the command, and writes the
# command's raw wait status to a pipe.

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
MAX_FD = 1 << 16  # what a command's init may hold open; the command gets only stdio


def needs_init(p: dict[str, Any]) -> bool:
    keys = ("network_forward", "view", "user", "cgroup_procs", "memory_procs", "nest")
    return any(p.get(key) for key in keys)


def _start_init(
    p: dict[str, Any],
    env: dict[str, str] | None,
    stdin_fd: int,
    out_w: int,
    err_w: int,
    prepare: Callable[[], None] | None = None,
) -> tuple[_Forked, int]:
    """Fork the command's init. ``prepare``: run in it first, by a parent that is no supervisor (the
    sandbox's server, folded.py): the init then takes a session of its own, as a supervisor would."""
    status_r, status_w = os.pipe()
    # The nested command's user namespace is mapped from here, where the ids are (nest.py).
    ready_r, ready_w, go_r, go_w = (*os.pipe(), *os.pipe()) if p.get("nest") else (-1, -1, -1, -1)
    pid = os.fork()
    if pid == 0:

        def init() -> int:
            proctree.name_process(b"rollout-init")
            if prepare is None:
                os.setpgid(0, 0)  # its own group, which the command joins: killpg reaches both
            else:
                os.setsid()
                prepare()
            signal.set_wakeup_fd(-1)  # our parent's wake-up pipe is not ours to write
            os.close(status_r)
            for fd, target in ((stdin_fd, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
                os.close(fd)
            if ready_w >= 0:
                os.close(ready_r)
                os.close(go_w)
                nest.enter(p["nest"]["hide"], ready_w, go_r)
            return _init(p, env, status_w)

        proctree.end_child("sandbox isolation", init)
    os.close(status_w)
    if ready_w >= 0:
        os.close(ready_w)
        os.close(go_r)
        try:
            nest.map_child(pid, ready_r, go_w)
        except OSError as exc:  # ours, not the command's (not yet started): no "cannot run" for it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(status_r)
            raise RuntimeError(f"sandbox isolation: {exc}"[:500]) from None
    return _Forked(pid), status_r


class _Forked:
    """The part of a Popen object the supervisor uses, for a child made by fork."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


def _init(p: dict[str, Any], env: dict[str, str] | None, status_fd: int) -> int:
    # Run by path with -I, our directory is not on sys.path.
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    forward, view, user = p.get("network_forward"), p.get("view"), p.get("user")
    # The sandbox's process and memory caps (sandboxes/pidlimit.py), before the view leaves /sys out.
    for procs, limit, controller in (
        ("cgroup_procs", "pids_max", "pids"),
        ("memory_procs", "memory_max", "memory"),
    ):
        if p.get(procs):
            import pidlimit

            if not pidlimit.member(p[procs], controller):  # born there, from the server it adopted: no move
                pidlimit.join(p[procs], int(p[limit]), controller)
    shared = p.get("view_fds") if view else None
    if shared:  # the sandbox's view, built once by its server (supervisor_server._build_view)
        proctree.libc_call("setns", int(shared[0]), CLONE_NEWNS)
        proctree.libc_call("setns", int(shared[1]), CLONE_NEWIPC)
        view = None  # nothing left to make of it here
    if view and p.get("host_mounts_fd") is not None:  # the server's, made before the session's mounts
        proctree.libc_call("setns", int(p["host_mounts_fd"]), CLONE_NEWNS)
        os.close(int(p["host_mounts_fd"]))
    sources = None
    if view and p.get("base_mounts_fd") is not None:
        import fsview

        # The view's sources from the host's tree, then a namespace of none of its mounts to build the
        # view in: a namespace unshared from the host's would copy (and at exit tear down) every one.
        sources = fsview.clone_sources(view)
        proctree.libc_call("setns", int(p["base_mounts_fd"]), CLONE_NEWNS)
        os.close(int(p["base_mounts_fd"]))
    flags = (CLONE_NEWNET if forward else 0) | (CLONE_NEWNS | CLONE_NEWIPC if view else 0)
    if flags:
        proctree.libc_call("unshare", flags)
    if view:
        import fsview

        fsview.apply(view, sources)
    listener = None
    if forward:
        import netns

        listener = netns.listen(int(forward[0]))
    if shared or view or user:
        # Nothing the command runs may gain privileges (a set-uid program), nor, as root, undo the view;
        # nor take over another process of the sandbox's (the harness's connections to the gateway).
        import seccomp

        proctree.prctl(PR_SET_NO_NEW_PRIVS, 1)
        proctree.prctl(proctree.PR_CAPBSET_DROP, proctree.CAP_SYS_ADMIN)
        seccomp.install()
    if listener is None:
        # Nothing of ours to keep running beside the command: become it. The supervisor then reaps the
        # command itself, and the status pipe (close-on-exec) carries no report. A process and a fork less.
        _exec_command(p, env, user, _command_limits(p), _candidates(p["argv"], env))
    command = _fork_exec(p, env, user)
    if listener is not None:  # threads only once the command is forked: a fork copies none of them
        netns.serve(listener, str(forward[1]), proc=str(forward[2]) if len(forward) > 2 else None)
    for fd in (0, 1, 2):  # the output pipes end when the command's side of them does
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    proctree.set_handler(signal.SIGCHLD, signal.SIG_DFL)
    status = proctree.wait_passing_signals(command, reap_all=False, unblock=True)
    os.write(status_fd, str(status).encode())
    return 0


def new_session_keyring() -> None:
    """Join a new, empty session keyring, so that nothing of the one this process was started in (its
    caller's login, a job's) is possessed by what it starts: the fork server's and a server's, each
    started by the worker, and the agent's on a node. A sandbox's commands cannot use one anyway
    (seccomp.py). Best effort: a kernel without keyrings has nothing to share."""
    number = _KEYCTL.get(os.uname().machine)
    if number is not None:
        ctypes.CDLL(None).syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None)


_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_JOIN_SESSION_KEYRING = 1


def _candidates(argv: list[str], env: dict[str, str] | None) -> list[str]:
    """Where ``argv[0]`` may be, as execvpe looks: resolved before the switch to the sandbox user, past
    which nothing may need a file of ours (an import, say)."""
    if os.sep in argv[0]:
        return [argv[0]]
    # os.get_exec_path's split, without its guard against bytes keys (ours are str), whose warnings filters
    # a forked init pays for in pages copied.
    path = (os.environ if env is None else env).get("PATH", os.defpath)
    return [os.path.join(d, argv[0]) for d in path.split(os.pathsep)]


def _fork_exec(p: dict[str, Any], env: dict[str, str] | None, user: list[int] | None) -> int:
    """Start the command as Popen would (its limits, the sandbox user, default signals, only stdio), by
    fork and exec: the init never imports `subprocess`, ~10 ms a command."""
    limits, candidates = _command_limits(p), _candidates(p["argv"], env)
    pid = os.fork()
    if pid:
        return pid
    _exec_command(p, env, user, limits, candidates)


def _exec_command(
    p: dict[str, Any],
    env: dict[str, str] | None,
    user: list[int] | None,
    limits: Callable[[], None] | None,
    candidates: list[str],
) -> NoReturn:
    """In the process that becomes the command: its limits, the sandbox user, default signals, only stdio,
    then exec. A failed start exits 127 (not found) or 126, saying why on stderr, as a shell would."""
    argv, command_env = p["argv"], os.environ if env is None else env
    code = 126
    try:
        for sig in (*_RESTORED_SIGNALS, *STOP_SIGNALS, signal.SIGCHLD):
            proctree.set_handler(sig, signal.SIG_DFL)
        proctree.block_signals(signal.SIG_SETMASK, ())
        os.chdir(p["cwd"])
        if p.get("memory_procs"):
            # The memory cap's OOM killer takes a command before a supervisor (pidlimit.py): raising
            # one's own score needs no privilege, where lowering the server's needs CAP_SYS_RESOURCE.
            proctree.write_small("/proc/self/oom_score_adj", "1000")
        if limits is not None:
            limits()
        if user:
            os.setgroups([])
            os.setresgid(user[1], user[1], user[1])
            os.setresuid(user[0], user[0], user[0])
        os.closerange(3, MAX_FD)
        failed: OSError | None = None
        for path in candidates:  # as execvpe: a later directory may still hold a runnable one
            try:
                os.execve(path, argv, command_env)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                failed = failed or exc
        raise failed or FileNotFoundError(2, "No such file or directory", argv[0])
    except BaseException as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        why = getattr(exc, "strerror", None) or exc
        os.write(2, f"cannot run {argv[0]!r}: {why}\n".encode(errors="replace"))
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------------------------
# Without a network namespace: posix_spawn, or Popen where a memory limit needs a hook before exec

# Signals Python ignores at start-up, which a command must get at their defaults (as Popen's
# restore_signals does); handled ones revert by themselves at exec.
_RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def _spawn(
    argv: list[str], cwd: str, env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> int:
    """Start ``argv`` as Popen would (its environment's PATH searched, its own process group, the
    given stdio, no other descriptor: every one of ours is close-on-exec) with posix_spawn, which needs
    no `subprocess` import and no copy of our address space. Raises the OSError of a failed start."""
    os.chdir(cwd)
    denied: OSError | None = None
    for path in _candidates(argv, env):
        # A check first: each spawn that fails costs a clone, where Popen tries every entry in one child.
        if not os.access(path, os.X_OK):
            if os.path.lexists(path):
                denied = denied or PermissionError(13, "Permission denied", path)
            continue
        try:
            return os.posix_spawn(
                path,
                argv,
                os.environ if env is None else env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                ],
                setpgroup=0,  # its own group in our session, so killpg reaches it in one call
                setsigmask=(),
                setsigdef=_RESTORED_SIGNALS,
            )
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as exc:  # as execvpe: a later directory may still hold a runnable one
            denied = denied or exc
    raise denied or FileNotFoundError(2, "No such file or directory", argv[0])


def _popen_limited(
    p: dict[str, Any], env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int
) -> subprocess.Popen[bytes]:
    """Start a command with an address-space limit, which only a hook between fork and exec can set;
    `subprocess` is imported for these alone."""
    import subprocess

    return subprocess.Popen(
        p["argv"],
        cwd=p["cwd"],
        env=env,
        stdin=stdin_fd,
        stdout=out_w,
        stderr=err_w,
        close_fds=True,
        process_group=0,
        preexec_fn=_command_limits(p),
    )


def _command_limits(p: dict[str, Any]) -> Callable[[], None] | None:
    """The hook that sets a command's RLIMIT_AS (``memory_limit_bytes``) and RLIMIT_FSIZE
    (``file_size_limit_bytes``) between fork and exec; None without either."""
    limits = [
        (limit_kind, int(value))
        for limit_kind, value in (
            (resource.RLIMIT_AS, p.get("memory_limit_bytes")),
            (resource.RLIMIT_FSIZE, p.get("file_size_limit_bytes")),
        )
        if value
    ]
    if not limits:
        return None

    def set_limits() -> None:  # runs in the forked child; we are single-threaded, so this is safe
        for kind, value in limits:
            resource.setrlimit(kind, (value, value))

    return set_limits


def _reported_status(status_pipe: int, init_status: int) -> int:
    """The command's wait status as its init reported it; the init's own if it died before reporting."""
    os.set_blocking(status_pipe, False)
    try:
        report = os.read(status_pipe, 64)
    except BlockingIOError:
        report = b""
    os.close(status_pipe)
    return int(report) if report.strip().isdigit() else init_status
