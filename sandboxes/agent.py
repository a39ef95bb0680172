"""The in-sandbox agent: a token-authenticated HTTP server that runs commands and moves files in a sandbox.

Standard library only, so it runs under whatever python3 an image or a compute node has; it ships next to
``supervisor.py`` and ``proctree.py`` (copied beside it, or imported from the package) and runs every
command under the supervisor, so an exec here gets what a local exec gets: its own session and process
group, capped output files, the timeout and the TTL, and the whole tree killed before the answer. The
supervisor needs python3 >= 3.11; this module itself keeps to python3 >= 3.8.

    python3 agent.py --root DIR (--token-file FILE | --token-env VAR) [--host H] [--port P]
                     [--ttl-s N] [--rendezvous FILE] [--max-connections N]
                     [--idle-timeout-s S] [--header-timeout-s S] [--run-as USER]
                     [--isolation off|auto|strict] [--hide PATH]... [--readonly PATH]...
                     [--loader LD.SO --library-path DIR]

``--isolation`` (default off) gives the commands the layers of agent_layers.py that the node allows: as
root, the ``--run-as`` user, a PID namespace, a loopback-only network reaching only the worker's gateway,
and a filesystem view hiding the node's secrets (``--hide`` adds paths, ``--readonly`` binds back paths
such as the harness cache); ``auto`` says in one line which it cannot make, ``strict`` refuses to start.

With no token it refuses to start. Once listening it writes ``--rendezvous`` (JSON: host, port, pid,
paths) atomically, which is how a starter on another machine learns it is ready and where. Endpoints
(all but none need ``Authorization: Bearer TOKEN``):

    GET  /health                      {"ok": true, ...}
    POST /exec       JSON             the supervisor's result (exit code, tails, byte counts, log paths)
    POST /upload?path=P&mode=M        body: the file's bytes (at most --max-upload-bytes)
    GET  /download?path=P&limit=N     the first N bytes of a regular file
    POST /untar?dest=P                body: an uncompressed tar, extracted without leaving the root
    POST /stop                        kills every exec's tree, answers, then exits

Layout under ``--root``: work/ (the workspace), home/, tmp/, logs/ (each exec's output), run/ (each
exec's supervisor files). Every path a request names must resolve inside the root.

Anything in the sandbox can reach the port, so a flood of connections must not sink it: at most
``--max-connections`` are served at once (a newcomer past that displaces the oldest connection still
waiting for its request, never one that has shown the token); a request's line and headers must arrive
whole within ``--header-timeout-s`` and ``MAX_HEADER_BYTES``; any read waits at most ``--idle-timeout-s``.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import http.client
import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

try:  # as part of the package
    from sandboxes import agent_layers, proctree, uidpool
    from sandboxes import supervisor as sup
except ImportError:  # copied beside supervisor.py and proctree.py into a sandbox
    import agent_layers  # type: ignore[no-redef]
    import proctree  # type: ignore[no-redef]
    import supervisor as sup  # type: ignore[no-redef]
    import uidpool  # type: ignore[no-redef]

SUPERVISOR_PATH = os.path.abspath(sup.__file__)
# How a supervisor's python is started: this interpreter, or (``--loader``) this interpreter through a
# loader and libraries of its own, carried into an image that has none that fit (sandboxes/runtime.py).
PYTHON = [sys.executable]
TOKEN_ENV = "ROLLOUT_AGENT_TOKEN"
TAIL_BYTES = 16_000
DEFAULT_MAX_UPLOAD = 256 * 1024 * 1024
DEFAULT_OUTPUT_CAP = 64 * 1024 * 1024
MAX_JSON_BYTES = 64 * 1024 * 1024  # an exec request carries argv, env and stdin
MAX_DOWNLOAD = 1024 * 1024 * 1024
SUPERVISOR_SLACK_S = sup.SLACK_S  # past the command's timeout; past that we kill its tree from here
STOP_GRACE_S = 1.0
# Members are vetted above; where tarfile has extraction filters, say so rather than get a warning.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
SUBDIRS = ("work", "home", "tmp", "logs", "run")
# What a command user (--run-as) owns: its workspace, home and tmp, and the baseline's git directory
# beside the workspace (sandboxes/workspace.py), made here since the user cannot write the root.
USER_DIRS = ("work", "home", "tmp", "baseline.git")
DEFAULT_MAX_CONNECTIONS = 64
# Above httpx's 5 s keep-alive expiry, so the worker drops an idle connection before we cut it.
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Counted as received while a request's line and headers are read, so it includes what the reader
# buffers ahead of the body (8 KiB at most); real requests carry well under 2 KiB of headers.
MAX_HEADER_BYTES = 64 * 1024


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
        self.running = {}  # type: dict[int, tuple[subprocess.Popen, bytes | None]]
        self.stopping = False
        self.started_at = time.time()
        # A view binds back only what exists: the baseline's git directory too (made later by the worker).
        for sub in SUBDIRS + (USER_DIRS if layers is not None and layers.filesystem else ()):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self.layers = layers or agent_layers.Layers()
        self.run_as = self.layers.user or run_as
        self.hidden = [self.root, *(hidden or [])]  # under a shared root: the control directory, its token
        # The supervisor's own directory too: a command's init imports its siblings once in the view.
        self.readonly = [os.path.dirname(SUPERVISOR_PATH), *(readonly or [])]
        self.relay = agent_layers.GatewayRelay() if self.layers.network else None
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
        params_path = os.path.join(run, stem + ".params.json")
        with open(params_path, "w", encoding="utf-8") as f:
            json.dump(params, f)
        marker = None
        if "ROLLOUT_SANDBOX" in env:
            marker = ("ROLLOUT_SANDBOX=" + env["ROLLOUT_SANDBOX"]).encode()
        started = time.monotonic()
        with self.lock:
            if self.stopping:
                raise AgentError(409, "the agent is stopping")
            with open(os.path.join(run, stem + ".supervisor.log"), "wb") as sup_log:
                # The command's environment is exactly what the client sent: nothing of ours leaks in.
                proc = subprocess.Popen(
                    [*PYTHON, "-I", "-S", SUPERVISOR_PATH, params_path],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=sup_log,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            self.running[proc.pid] = (proc, marker)
        killed = False
        try:
            budget = min(float(timeout), max(0.0, deadline - time.time())) + STOP_GRACE_S + SUPERVISOR_SLACK_S
            try:
                proc.wait(budget)
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
        return self._result(files, proc, killed, time.monotonic() - started)

    def _isolation_params(self, gateway: object) -> dict:
        """The supervisor's ``network_forward`` and ``view`` for one command. ``gateway``: [host, port] of
        the worker's gateway, which the command reaches at 127.0.0.1:port; without one, nothing."""
        out = {}  # type: dict
        relay = None
        if self.relay is not None:
            if gateway is not None:
                if not (isinstance(gateway, list) and len(gateway) == 2 and isinstance(gateway[0], str)):
                    raise AgentError(400, f"gateway must be [host, port], not {gateway!r}"[:300])
                with self.lock:
                    relay = self.relay.socket_for(gateway[0], int(gateway[1]))
                out["network_forward"] = [int(gateway[1]), relay]
            else:  # the namespace with only lo; its listener relays to a socket that does not exist
                out["network_forward"] = [0, os.path.join(self.relay.dir, "none.sock")]
        if self.layers.filesystem:
            out["view"] = agent_layers.view(self.root, self.hidden, self.readonly, relay, self.account_files)
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
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        clean = True
        for proc, marker in running:
            roots = [proc.pid] if proc.poll() is None else []
            clean = self._kill_tree(roots, marker) and clean
        if self.relay is not None:
            self.relay.close()
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


class HeaderTooLarge(http.client.HTTPException):
    """A request's line and headers ran past ``MAX_HEADER_BYTES``."""


class _Conn:
    """One accepted connection as the connection cap sees it."""

    __slots__ = ("evicted", "since", "sock", "trusted", "waiting")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.since = time.monotonic()
        self.waiting = True  # for a request's line and headers, as opposed to serving one
        self.trusted = False  # has carried the token
        self.evicted = False


class _DeadlineReader(io.RawIOBase):
    """The socket as a handler reads it. Every read waits at most the idle timeout; a request's line and
    headers must also arrive whole within the header timeout from their first byte, and within
    ``MAX_HEADER_BYTES``, since a client trickling a byte at a time would reset a per-read timeout forever."""

    def __init__(self, sock: socket.socket, idle_s: float, header_s: float) -> None:
        super().__init__()
        self.sock = sock
        self.idle_s = idle_s
        self.header_s = header_s
        self.in_headers = False
        self.deadline = None  # type: float | None
        self.header_bytes = 0

    def readable(self) -> bool:
        return True

    def begin_headers(self) -> None:
        self.in_headers, self.deadline, self.header_bytes = True, None, 0

    def end_headers(self) -> None:
        self.in_headers = False
        self.sock.settimeout(self.idle_s)  # the answer's writes must not inherit a nearly spent deadline

    def readinto(self, buf: bytearray) -> int:  # type: ignore[override]
        timeout = self.idle_s
        if self.in_headers and self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                # socket.timeout, not TimeoutError: before 3.10 only the former is what the handler catches.
                raise socket.timeout(f"headers not complete within {self.header_s:g} s")  # noqa: UP041
        self.sock.settimeout(timeout)
        n = self.sock.recv_into(buf)
        if self.in_headers and n:
            if self.deadline is None:
                self.deadline = time.monotonic() + self.header_s
            self.header_bytes += n
            if self.header_bytes > MAX_HEADER_BYTES:
                raise HeaderTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes")
        return n


class Handler(BaseHTTPRequestHandler):
    server_version = "rollout-agent/1"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the second waits for the client's
    # delayed ACK (~40 ms on every request).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        server: AgentServer = self.server  # type: ignore[assignment]
        self.rfile.close()  # the socket's own reader, replaced by one that keeps the deadlines
        self._reader = _DeadlineReader(self.connection, server.idle_timeout_s, server.header_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self.server.mark(self.request, waiting=True)  # type: ignore[attr-defined]
        self._reader.begin_headers()
        try:
            super().handle_one_request()
        except HeaderTooLarge:
            self.close_connection = True  # what was read of it cannot be told from the next request

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._reader.end_headers()
        self.server.mark(self.request, waiting=False)  # type: ignore[attr-defined]
        return ok

    @property
    def agent(self) -> Agent:
        return self.server.agent  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request is noise; errors go in the answers

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: dict) -> None:
        self._send(status, json.dumps(data).encode())

    def _body(self, limit: int) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise AgentError(411, "a Content-Length is required")
        if int(length) > limit:
            self.close_connection = True  # the unread body must not be taken for the next request
            raise AgentError(413, f"body of {length} bytes exceeds the limit of {limit}")
        return self.rfile.read(int(length))

    def _handle(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if not self.agent.authorized(self.headers.get("Authorization")):
                self.close_connection = True
                raise AgentError(401, "missing or wrong token")
            self.server.mark(self.request, trusted=True)  # type: ignore[attr-defined]
            route = (method, url.path)
            if route == ("GET", "/health"):
                a = self.agent
                self._json(
                    200,
                    {
                        "ok": True,
                        "pid": os.getpid(),
                        "root": a.root,
                        "running": len(a.running),
                        "isolation": a.layers.label,
                        "missing": a.layers.missing,
                    },
                )
            elif route == ("POST", "/exec"):
                req = json.loads(self._body(MAX_JSON_BYTES) or b"{}")
                self._json(200, self.agent.exec(req))
            elif route == ("POST", "/upload"):
                mode = int(query.get("mode", "644"), 8)
                data = self._body(self.agent.max_upload_bytes)
                self.agent.upload(query.get("path", ""), mode & 0o7777, data)
                self._json(200, {"ok": True, "bytes": len(data)})
            elif route == ("GET", "/download"):
                limit = min(int(query.get("limit", str(MAX_DOWNLOAD))), MAX_DOWNLOAD)
                if limit < 0:
                    raise AgentError(400, "negative limit")
                self._send(200, self.agent.download(query.get("path", ""), limit), "application/octet-stream")
            elif route == ("POST", "/untar"):
                data = self._body(self.agent.max_upload_bytes)
                count = self.agent.untar(query.get("dest", "."), data)
                self._json(200, {"ok": True, "members": count})
            elif route == ("POST", "/stop"):
                clean = self.agent.stop()
                self._json(200, {"ok": True, "clean": clean})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
            else:
                raise AgentError(404, "no route {} {}".format(*route))
        except AgentError as exc:
            self._json(exc.status, {"error": str(exc)[:4000]})
        except (ValueError, KeyError, TypeError, tarfile.TarError) as exc:
            self._json(400, {"error": (f"{type(exc).__name__}: {exc}")[:4000]})
        except socket.timeout:  # noqa: UP041 (python3.8 in agent images: not yet an alias of TimeoutError)
            self.close_connection = True  # a body stalled past the idle timeout: nobody waits for an answer
        except OSError as exc:
            self._json(500, {"error": (f"{type(exc).__name__}: {exc}")[:4000]})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")


_BUSY_BODY = b'{"error": "too many connections being served at once"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


class AgentServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them serving at once. A newcomer past the
    cap displaces the oldest connection still waiting for its request that has never carried the token;
    with none to displace it is answered 503. Displaced ones whose threads have not yet ended still count
    against a hard bound of twice the cap, so threads and descriptors stay bounded whatever arrives."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple,
        agent: Agent,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    ) -> None:
        if max_connections < 1 or idle_timeout_s <= 0 or header_timeout_s <= 0:
            raise ValueError("max_connections and both timeouts must be positive")
        self.agent = agent
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.header_timeout_s = header_timeout_s
        self.conns = {}  # type: dict[socket.socket, _Conn]
        self.conns_lock = threading.Lock()
        super().__init__(address, Handler)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self.conns_lock:
            admitted = self._make_room()
            if admitted:
                self.conns[request] = _Conn(request)
        if not admitted:
            try:
                request.setblocking(False)  # a fresh socket's buffer takes this; never wait on the caller
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def _make_room(self) -> bool:
        """Under ``conns_lock``: whether one more connection may be served, displacing one if need be."""
        live = [c for c in self.conns.values() if not c.evicted]
        if len(live) < self.max_connections:
            return True
        idle = [c for c in live if c.waiting and not c.trusted]
        if not idle or len(self.conns) >= 2 * self.max_connections:
            return False
        victim = min(idle, key=lambda c: c.since)
        victim.evicted = True
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once and its thread ends
        except OSError:
            pass
        return True

    def mark(self, request: socket.socket, *, waiting: bool | None = None, trusted: bool = False) -> None:
        with self.conns_lock:
            conn = self.conns.get(request)
            if conn is None:
                return
            if waiting is not None:
                conn.waiting = waiting
                conn.since = time.monotonic()
            conn.trusted = conn.trusted or trusted

    def close_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self.conns_lock:
            self.conns.pop(request, None)
        super().close_request(request)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client gone mid-answer is routine under load, and a traceback each would fill a pipe nobody reads.
        if not isinstance(sys.exc_info()[1], OSError):
            print(f"agent: request failed: {sys.exc_info()[1]!r}"[:500], file=sys.stderr)


class UnixHandler(Handler):
    disable_nagle_algorithm = False  # a TCP option; there is no Nagle on a Unix socket

    def address_string(self) -> str:
        return "unix"


class UnixAgentServer(AgentServer):
    """The agent on a Unix socket: for a sandbox with no network (a container's), whose starter reaches
    the socket through a directory both share."""

    address_family = socket.AF_UNIX

    def __init__(self, path: str, agent: Agent, **kw: float) -> None:
        super().__init__(path, agent, **kw)  # type: ignore[arg-type]
        self.RequestHandlerClass = UnixHandler

    def server_bind(self) -> None:
        # HTTPServer's would look the path up as a host name.
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = "localhost", 0


def _read_token(args: argparse.Namespace) -> str:
    if args.token_file:
        with open(args.token_file, encoding="ascii") as f:
            return f.read().strip()
    if args.token_env:
        return os.environ.pop(args.token_env, "").strip()  # not passed on to anything we start
    return ""


def _write_rendezvous(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description="The in-sandbox agent.")
    parser.add_argument("--root", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertise", default=None, help="the host others should dial (default: --host)")
    parser.add_argument("--token-file")
    parser.add_argument("--token-env")
    parser.add_argument("--ttl-s", type=float, default=None)
    parser.add_argument("--rendezvous")
    parser.add_argument("--max-upload-bytes", type=int, default=DEFAULT_MAX_UPLOAD)
    parser.add_argument("--output-cap-bytes", type=int, default=DEFAULT_OUTPUT_CAP)
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS)
    parser.add_argument("--idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S)
    parser.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S)
    parser.add_argument("--unix-socket", help="listen on this Unix socket instead of --host/--port")
    parser.add_argument("--unconfined", action="store_true", help="requests may name paths outside --root")
    parser.add_argument("--run-as", help="run every command as this unprivileged user (needs root)")
    parser.add_argument("--isolation", choices=("off", "auto", "strict"), default="off")
    parser.add_argument(
        "--uid-pool", action="store_true", help="as root, run the commands as a uid of the node's pool"
    )
    parser.add_argument("--hide", action="append", default=[], help="a path no command may see")
    parser.add_argument("--readonly", action="append", default=[], help="a path commands see read-only")
    parser.add_argument("--loader", help="start the supervisor's python through this dynamic loader")
    parser.add_argument("--library-path", help="the loader's --library-path (with --loader)")
    args = parser.parse_args(argv)
    if args.loader:
        PYTHON[:] = [args.loader, "--library-path", args.library_path or "", sys.executable]
    try:
        token = _read_token(args)
    except OSError as exc:
        print(f"agent: cannot read the token: {exc}", file=sys.stderr)
        return 2
    if not token:
        print("agent: no token (--token-file or --token-env): refusing to start", file=sys.stderr)
        return 2
    try:
        layers = agent_layers.resolve(args.isolation, args.run_as, args.uid_pool)
    except ValueError as exc:
        print(f"agent: {exc}"[:1000], file=sys.stderr)
        return 2
    if layers.missing:
        print(
            f"agent: isolation {args.isolation!r}: commands run without " + "; ".join(layers.missing),
            file=sys.stderr,
        )
    host_pid = os.getpid()  # what the node's tools (ps, slurmstepd) know the agent by
    if layers.pids and not layers.bwrap:  # bubblewrap makes one per command
        agent_layers.enter_pid_namespace()  # from here on, the agent inside it
    agent = Agent(
        args.root,
        token,
        ttl_s=args.ttl_s,
        max_upload_bytes=args.max_upload_bytes,
        output_cap_bytes=args.output_cap_bytes,
        confined=not args.unconfined,
        layers=layers,
        hidden=args.hide,
        readonly=args.readonly,
    )
    limits = dict(
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout_s,
        header_timeout_s=args.header_timeout_s,
    )
    if args.unix_socket:
        server = UnixAgentServer(args.unix_socket, agent, **limits)  # type: AgentServer
    else:
        server = AgentServer((args.host, args.port), agent, **limits)

    def on_signal(_signum: int, _frame: object) -> None:
        # scancel and StopTask send SIGTERM first: end the exec trees, then leave.
        threading.Thread(target=lambda: (agent.stop(), server.shutdown()), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if agent.deadline is not None:
        timer = threading.Timer(max(0.0, agent.deadline - time.time()), on_signal, (0, None))
        timer.daemon = True
        timer.start()
    host, port = (args.unix_socket, 0) if args.unix_socket else server.server_address[:2]
    if args.rendezvous:
        _write_rendezvous(
            args.rendezvous,
            {
                "host": args.advertise or host,
                "port": port,
                "pid": host_pid,
                "root": agent.root,
                "isolation": layers.label,
                "missing": layers.missing,
                "workdir": os.path.join(agent.root, "work"),
                "home": os.path.join(agent.root, "home"),
                "tmpdir": os.path.join(agent.root, "tmp"),
                "node": os.uname()[1],
                "started_at": agent.started_at,
            },
        )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        agent.stop()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
