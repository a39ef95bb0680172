"""The in-sandbox agent's commands (sandboxes/agent.py serves them over HTTP): the sandbox's tree, paths
confined to its root, files moved in and out, and each command run under the supervisor with the layers
of agent_layers.py. Standard library only, shipped beside agent.py like its other siblings.
"""

from __future__ import annotations

import base64
import hmac
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
import uuid

try:  # as part of the package
    from sandboxes import agent_layers, agent_supervisors, pidlimit, proctree, uidpool
    from sandboxes import supervisor as sup
except ImportError:  # copied beside supervisor.py and proctree.py into a sandbox
    import agent_layers  # type: ignore[no-redef]
    import agent_supervisors  # type: ignore[no-redef]
    import pidlimit  # type: ignore[no-redef]
    import proctree  # type: ignore[no-redef]
    import supervisor as sup  # type: ignore[no-redef]
    import uidpool  # type: ignore[no-redef]

SUPERVISOR_PATH = os.path.abspath(sup.__file__)
# How a supervisor's python is started: this interpreter, or (``--loader``) this interpreter through a
# loader and libraries of its own, carried into an image that has none that fit (sandboxes/runtime.py).
PYTHON = [sys.executable]
TAIL_BYTES = 16_000
DEFAULT_MAX_UPLOAD = 256 * 1024 * 1024
DEFAULT_OUTPUT_CAP = 64 * 1024 * 1024
MAX_DOWNLOAD = 1024 * 1024 * 1024
SUPERVISOR_SLACK_S = sup.SLACK_S  # past the command's timeout; past that we kill its tree from here
STOP_GRACE_S = 1.0
# Members are vetted above; where tarfile has extraction filters, say so rather than get a warning.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
SUBDIRS = ("work", "home", "tmp", "logs", "run")
# What a command user (--run-as) owns: its workspace, home and tmp, and the baseline's git directory
# beside the workspace (sandboxes/workspace.py), made here since the user cannot write the root.
USER_DIRS = ("work", "home", "tmp", "baseline.git")


def wait_exit(proc: subprocess.Popen | agent_supervisors.ServedSupervisor, timeout: float) -> None:
    """``proc.wait(timeout)``, returning as soon as the process ends: Popen's own wait with a timeout
    polls, sleeping up to 50 ms between looks, which made every command through an agent ~30 ms late
    (an exec of `true` 68 ms)."""
    if isinstance(proc, agent_supervisors.ServedSupervisor):  # ends when its server reports it
        proc.wait(timeout)
        return
    try:
        ended = proctree.ended_within(proc.pid, timeout)
    except (AttributeError, OSError):  # no pidfds here
        proc.wait(timeout)
        return
    if not ended:
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait()


class AgentError(Exception):
    """A request the agent refuses; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Agent:
    """The state behind the server: the root, the running supervisors, the TTL."""

    def __init__(
        self,
        root: str,
        token: str,
        *,
        ttl_s: float | None = None,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
        output_cap_bytes: int = DEFAULT_OUTPUT_CAP,
        confined: bool = True,
        run_as: tuple | None = None,
        layers: agent_layers.Layers | None = None,
        hidden: list | None = None,
        readonly: list | None = None,
    ) -> None:
        """``run_as`` (uid, gid): every command runs as that unprivileged user, which owns the workspace,
        home and tmp (and the baseline's git directory) and nothing else; the agent needs root for it.
        ``layers``: what else isolates the commands (agent_layers.py); its user wins over ``run_as``.
        ``hidden``/``readonly``: more paths the filesystem view hides or binds back read-only."""
        if not token:
            raise ValueError("the agent needs a token")
        self.root = os.path.realpath(root)
        self.token = token.encode()
        self.deadline = time.time() + ttl_s if ttl_s else None
        self.max_upload_bytes = max_upload_bytes
        self.output_cap_bytes = output_cap_bytes
        # Unconfined: paths anywhere in the sandbox's filesystem, for an agent whose sandbox is a whole
        # container (the task's image keeps its workspace and tests where it chose).
        self.confined = confined
        self.lock = threading.Lock()
        self.running = {}  # type: dict[int, tuple[subprocess.Popen | agent_supervisors.ServedSupervisor, bytes | None]]
        self.stopping = False
        self.started_at = time.time()
        # A view binds back only what exists: the baseline's git directory too (made later by the worker).
        for sub in SUBDIRS + (USER_DIRS if layers is not None and layers.filesystem else ()):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self.layers = layers or agent_layers.Layers()
        self.run_as = self.layers.user or run_as
        self.hidden = [self.root, *(hidden or [])]  # under a shared root: the control directory, its token
        # What a nested command (nest.py) must not see: the results and logs, and what --hide names (a
        # container's control directory and gateway sockets).
        self.nest_hidden = [os.path.join(self.root, sub) for sub in ("run", "logs")] + list(hidden or [])
        # The supervisor's own directory too: a command's init imports its siblings once in the view.
        self.readonly = [os.path.dirname(SUPERVISOR_PATH), *(readonly or [])]
        self.relay = agent_layers.GatewayRelay() if self.layers.network else None
        # The memory cap the sandbox's commands share with us (a container's, a job's), if it has one: a
        # command that failed while the kernel killed processes for it says so, as a local sandbox's does.
        self.memory_group = pidlimit.own_memory_group()
        # Called before a nested command starts, so what serves the worker meanwhile is there before it.
        self.before_nested = None  # type: Callable[[], None] | None
        server_log = os.path.join(self.root, "run", "server.log")
        self.supervisors = agent_supervisors.SupervisorServer(PYTHON, server_log)
        self.account_files = None  # type: dict | None
        if self.layers.lease is not None:  # a uid with no account: the view names it (uidpool.py)
            uid, gid = self.run_as
            passwd, group = uidpool.account_files(uid, gid, os.path.join(self.root, "home"))
            self.account_files = {}
            for name, text in (("passwd", passwd), ("group", group)):
                with open(os.path.join(self.root, name), "w", encoding="utf-8") as f:
                    f.write(text)
                self.account_files["/etc/" + name] = os.path.join(self.root, name)
        if self.run_as is not None:
            # The root stays ours (the commands' results and logs, the token's neighbours): the user may
            # pass through it to what is its own, never list or write it.
            os.chmod(self.root, 0o711)
            for sub in USER_DIRS:
                path = os.path.join(self.root, sub)
                os.makedirs(path, mode=0o700, exist_ok=True)
                self.give(path)

    def give(self, path: str) -> None:
        """Make ``path`` (and what is under it) the command user's, links themselves and not their targets."""
        if self.run_as is None:
            return
        uid, gid = self.run_as
        os.lchown(path, uid, gid)
        if os.path.isdir(path) and not os.path.islink(path):
            for top, dirs, files in os.walk(path):
                for name in dirs + files:
                    os.lchown(os.path.join(top, name), uid, gid)

    # -- auth and paths ---------------------------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer ") :].encode(), self.token)

    def inside(self, path: str) -> str:
        """The real path of ``path`` (absolute, or relative to work/), refused if it leaves the root."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise AgentError(400, f"invalid path {path!r}")
        candidate = path if os.path.isabs(path) else os.path.join(self.root, "work", path)
        real = os.path.realpath(candidate)
        if self.confined and os.path.commonpath([real, self.root]) != self.root:
            raise AgentError(403, f"path {path!r} resolves outside the sandbox root")
        return real

    # -- files ------------------------------------------------------------------------------------------

    def upload(self, path: str, mode: int, data: bytes) -> None:
        real = self.inside(path)
        parent = os.path.dirname(real)
        made = []  # type: list[str]
        while not os.path.exists(parent):
            made.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        self.inside(os.path.dirname(real))  # the directories just made must still be ours
        fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
            if self.run_as is not None:
                os.fchown(f.fileno(), *self.run_as)
        for directory in made:
            self.give(directory)

    def download(self, path: str, limit: int) -> bytes:
        real = self.inside(path)
        try:
            # O_NONBLOCK: a FIFO planted at this path must not hang the request in open().
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise AgentError(404, f"no file {path!r}") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise AgentError(400, f"{path!r} is not a regular file")
            return f.read(limit)

    def untar(self, dest: str, data: bytes) -> int:
        """Extract a tar into ``dest``; any member or link target outside ``dest`` refuses the whole."""
        base = self.inside(dest)
        os.makedirs(base, exist_ok=True)

        def within(path: str) -> bool:
            return os.path.commonpath([os.path.normpath(path), base]) == base

        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            for m in members:
                target = os.path.join(base, m.name)
                if os.path.isabs(m.name) or not within(target):
                    raise AgentError(403, f"tar member {m.name!r} leaves {dest!r}")
                if m.islnk() or not (m.isfile() or m.isdir() or m.issym()):
                    raise AgentError(400, f"tar member {m.name!r} is not a file, directory or symlink")
                if m.issym() and not within(os.path.join(os.path.dirname(target), m.linkname)):
                    raise AgentError(403, f"symlink {m.name!r} points outside {dest!r}")
            for m in members:
                # Checked again at extraction time: an earlier member may have become a symlink parent.
                self.inside(os.path.dirname(os.path.join(base, m.name)))
                tar.extract(m, base, set_attrs=not m.issym(), **_TRUSTED)
        self.give(base)
        return len(members)

    # -- exec -------------------------------------------------------------------------------------------

    def exec(self, req: dict) -> dict:
        argv, env = req.get("argv"), req.get("env")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise AgentError(400, "argv must be a non-empty list of strings")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise AgentError(400, "env must be a mapping of strings")
        timeout = req.get("timeout")
        if not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise AgentError(400, f"invalid timeout {timeout!r}")
        cwd = self.inside(req.get("cwd") or os.path.join(self.root, "work"))
        if not os.path.isdir(cwd):
            raise AgentError(400, f"working directory {cwd!r} is not a directory")
        deadline = self.deadline or time.time() + float(timeout) + 3600
        if time.time() >= deadline:
            raise AgentError(409, "the sandbox is past its TTL")
        stem = "{}.{}".format(str(req.get("name") or "exec")[:60].replace("/", "_"), uuid.uuid4().hex[:8])
        logs, run = os.path.join(self.root, "logs"), os.path.join(self.root, "run")
        files = {
            "stdout_path": os.path.join(logs, stem + ".stdout"),
            "stderr_path": os.path.join(logs, stem + ".stderr"),
            "result_path": os.path.join(run, stem + ".result.json"),
        }
        for key in ("stdout_path", "stderr_path"):
            open(files[key], "wb").close()
        stdin_path = None
        if req.get("stdin_b64") is not None:
            stdin_path = os.path.join(run, stem + ".stdin")
            with open(stdin_path, "wb") as f:
                f.write(base64.b64decode(req["stdin_b64"]))
        memory_mb = req.get("memory_limit_mb")
        layers = self._isolation_params(req.get("gateway"))
        if self.layers.bwrap:  # bubblewrap makes them around the command, not the supervisor
            argv, layers = agent_layers.bwrap_argv(layers, argv), {}
        params = dict(
            files,
            argv=argv,
            cwd=cwd,
            stdin_path=stdin_path,
            timeout_s=float(timeout),
            deadline_epoch=deadline,
            parent_pid=os.getpid(),
            output_cap_bytes=self.output_cap_bytes,
            tail_bytes=TAIL_BYTES,
            kill_grace_s=STOP_GRACE_S,
            nofile_limit=65_536,
            memory_limit_bytes=int(memory_mb) * 1024 * 1024 if memory_mb else None,
            user=list(self.run_as) if self.run_as else None,
            **layers,
        )
        if self.layers.nest:
            params["nest"] = {"hide": self.nest_hidden}
            if self.before_nested is not None:
                self.before_nested()
        marker = None
        if "ROLLOUT_SANDBOX" in env:
            marker = ("ROLLOUT_SANDBOX=" + env["ROLLOUT_SANDBOX"]).encode()
        started = time.monotonic()
        oom_before = pidlimit.oom_kills(self.memory_group[0]) if self.memory_group else 0
        with self.lock:
            if self.stopping:
                raise AgentError(409, "the agent is stopping")
            proc = self._start_supervisor(params, env, os.path.join(run, stem))
            self.running[proc.pid] = (proc, marker)
        killed = False
        try:
            budget = min(float(timeout), max(0.0, deadline - time.time())) + STOP_GRACE_S + SUPERVISOR_SLACK_S
            try:
                wait_exit(proc, budget)
            except subprocess.TimeoutExpired:
                killed = True
                self._kill_tree([proc.pid], marker)
                try:
                    proc.wait(SUPERVISOR_SLACK_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            with self.lock:
                self.running.pop(proc.pid, None)
            if stdin_path:
                _unlink(stdin_path)
        out = self._result(files, proc, killed, time.monotonic() - started)
        if self.memory_group:
            kills = out["oom_kills"] = pidlimit.oom_kills(self.memory_group[0]) - oom_before
            if kills and out["exit_code"] != 0 and not out["timed_out"]:
                out["limit"] = pidlimit.killed_by_cap(self.memory_group[1], kills)
        return out

    def _start_supervisor(
        self, params: dict, env: dict, stem: str
    ) -> subprocess.Popen | agent_supervisors.ServedSupervisor:
        """A supervisor for ``params``, the command's environment ``env``: forked by the agent's server,
        or, where there is none to be had, an interpreter of its own; its stderr in STEM.supervisor.log."""
        if not self.supervisors.failed:
            try:
                return self.supervisors.spawn(params, env, stem + ".supervisor.log")
            except agent_supervisors.ServerLost:
                pass  # nothing started: this command as before; the next tries a server again
            except agent_supervisors.RequestLost as exc:  # never run twice: it may have started
                raise AgentError(410, str(exc)) from exc
        params_path = stem + ".params.json"
        with open(params_path, "w", encoding="utf-8") as f:
            json.dump(params, f)
        with open(stem + ".supervisor.log", "wb") as sup_log:
            # The command's environment is exactly what the client sent: nothing of ours leaks in.
            return subprocess.Popen(
                [*PYTHON, "-I", "-S", SUPERVISOR_PATH, params_path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=sup_log,
                cwd=params["cwd"],
                env=env,
                start_new_session=True,
            )

    def _isolation_params(self, gateway: object) -> dict:
        """The supervisor's ``network_forward`` and ``view`` for one command. ``gateway``: [host, port] of
        the worker's gateway, which the command reaches at 127.0.0.1:port, and the gateway's port for
        what the harness's process did not open, if it has one; without one, nothing."""
        out = {}  # type: dict
        relays = []  # type: list
        if self.relay is not None:
            if gateway is not None:
                if not (
                    isinstance(gateway, list)
                    and len(gateway) in (2, 3)
                    and isinstance(gateway[0], str)
                    and all(isinstance(port, int) for port in gateway[1:])
                ):
                    raise AgentError(400, f"gateway must be [host, port, other port], not {gateway!r}"[:300])
                with self.lock:
                    relays.append(self.relay.socket_for(gateway[0], gateway[1]))
                    if len(gateway) == 3:
                        relays.append(self.relay.socket_for(gateway[0], gateway[2], other_of=relays[0]))
                out["network_forward"] = [gateway[1], relays[0]]
                if len(relays) == 2 and self.layers.pids and not self.layers.bwrap:
                    # The commands' /proc is the agent's PID namespace's: its forwarder tells the harness's
                    # connections from the rest (netns.py).
                    out["network_forward"].append("/proc")
            else:  # the namespace with only lo; its listener relays to a socket that does not exist
                out["network_forward"] = [0, os.path.join(self.relay.dir, "none.sock")]
        if self.layers.filesystem:
            out["view"] = agent_layers.view(self.root, self.hidden, self.readonly, relays, self.account_files)
        return out

    def _result(self, files: dict, proc: subprocess.Popen, killed: bool, duration: float) -> dict:
        try:
            with open(files["result_path"], encoding="utf-8") as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = None
        out = {"stdout_path": files["stdout_path"], "stderr_path": files["stderr_path"]}
        out["duration_s"] = duration
        if res is None:
            if killed and not self.stopping:
                out.update(exit_code=None, signal=signal.SIGKILL, timed_out=True)
                for key in ("stdout", "stderr"):
                    size, tail = _file_tail(files[key + "_path"])
                    out[key + "_bytes"], out[key + "_tail_b64"] = size, _b64(tail)
                return out
            raise AgentError(410, f"supervisor ended (status {proc.returncode}) without a result")
        if res.get("error"):
            raise AgentError(500, "exec failed: {}".format(str(res["error"])[:2000]))
        if res["reason"] == "terminated":
            raise AgentError(410, "the sandbox was stopped while the command ran")
        out.update(
            exit_code=res["exit_code"],
            signal=res["signal"],
            timed_out=bool(res["timed_out"]),
            stdout_bytes=int(res.get("stdout_bytes", 0)),
            stderr_bytes=int(res.get("stderr_bytes", 0)),
            stdout_tail_b64=res.get("stdout_tail_b64", ""),
            stderr_tail_b64=res.get("stderr_tail_b64", ""),
        )
        return out

    # -- end of life ------------------------------------------------------------------------------------

    def _kill_tree(self, roots: list, marker: bytes | None) -> bool:
        me = os.getpid()

        def find() -> set:
            procs = proctree.snapshot()
            found = set()
            for root in roots:
                if root in procs and procs[root].alive:
                    found |= {root} | proctree.descendants(procs, root)
            if marker is not None:
                found |= {p for p, i in procs.items() if i.alive and proctree.has_env_entry(p, marker)}
            found.discard(me)
            return {p for p in found if p in procs and procs[p].alive}

        return proctree.kill_processes(find, grace_s=0, idle=time.sleep)

    def stop(self) -> bool:
        """Ask every supervisor to end its tree, then force whatever is left; idempotent."""
        with self.lock:
            self.stopping = True
            running = list(self.running.values())
        for proc, _marker in running:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STOP_GRACE_S + sup.DRAIN_S + 2.0
        for proc, _marker in running:
            try:
                wait_exit(proc, max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        clean = True
        for proc, marker in running:
            roots = [proc.pid] if proc.poll() is None else []
            clean = self._kill_tree(roots, marker) and clean
        if self.relay is not None:
            self.relay.close()
        self.supervisors.close(STOP_GRACE_S)
        return clean


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _file_tail(path: str) -> tuple:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            return size, f.read(TAIL_BYTES)
    except OSError:
        return 0, b""
