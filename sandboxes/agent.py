"""The in-sandbox agent: a token-authenticated HTTP server that runs commands and moves files in a sandbox.

Standard library only, so it runs under whatever python3 an image or a compute node has; it ships next to
``supervisor.py`` and ``proctree.py`` (copied beside it, or imported from the package) and runs every
command under the supervisor, so an exec here gets what a local exec gets: its own session and process
group, capped output files, the timeout and the TTL, and the whole tree killed before the answer. Each
command's supervisor is forked by one pre-imported server the agent starts beside itself
(agent_supervisors.py). The supervisor needs python3 >= 3.11; this module itself keeps to python3 >= 3.8.

    python3 agent.py --root DIR (--token-file FILE | --token-env VAR) [--host H] [--port P]
                     [--ttl-s N] [--rendezvous FILE] [--max-connections N]
                     [--idle-timeout-s S] [--header-timeout-s S] [--run-as USER]
                     [--isolation off|auto|strict] [--nest] [--hide PATH]... [--readonly PATH]...
                     [--loader LD.SO --library-path DIR]

``--isolation`` (default off) gives the commands the layers of agent_layers.py that the node allows: as
root, the ``--run-as`` user, a PID namespace, a loopback-only network reaching only the worker's gateway,
and a filesystem view hiding the node's secrets (``--hide`` adds paths, ``--readonly`` binds back paths
such as the harness cache); ``auto`` says in one line which it cannot make, ``strict`` refuses to start.
``--nest`` (a container's agent, whose commands run as root beside it): each command in a Landlock
domain and a user and mount namespace of its own, out of reach of the agent's processes and files, its
results, logs and what ``--hide`` names (nest.py).

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
import collections
import http.client
import io
import json
import os
import signal
import socket
import sys
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

try:  # as part of the package
    from sandboxes import agent_layers, spawn
    from sandboxes.agent_commands import (
        DEFAULT_MAX_UPLOAD,
        DEFAULT_OUTPUT_CAP,
        MAX_DOWNLOAD,
        PYTHON,
        Agent,
        AgentError,
    )
except ImportError:  # copied beside agent_commands.py, supervisor.py and proctree.py into a sandbox
    import agent_layers  # type: ignore[no-redef]
    import spawn  # type: ignore[no-redef]
    from agent_commands import (  # type: ignore[no-redef]
        DEFAULT_MAX_UPLOAD,
        DEFAULT_OUTPUT_CAP,
        MAX_DOWNLOAD,
        PYTHON,
        Agent,
        AgentError,
    )

TOKEN_ENV = "ROLLOUT_AGENT_TOKEN"
MAX_JSON_BYTES = 64 * 1024 * 1024  # an exec request carries argv, env and stdin
DEFAULT_MAX_CONNECTIONS = 64
# Above httpx's 5 s keep-alive expiry, so the worker drops an idle connection before we cut it.
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Counted as received while a request's line and headers are read, so it includes what the reader
# buffers ahead of the body (8 KiB at most); real requests carry well under 2 KiB of headers.
MAX_HEADER_BYTES = 64 * 1024


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
    against a hard bound of twice the cap, so threads and descriptors stay bounded whatever arrives.

    A thread whose connection has ended serves the next one, and a new thread starts only when none is
    free, or ahead of a nested command (``keep_spare``): the connections the worker opens while a root
    command runs (its stop, a probe) find threads that were there before it began, which it finds sealed
    (sandboxes/nest.py); a thread started after it would have a /proc/TID/oom_score_adj, its whole
    process's, the command could raise."""

    SPARE = 2  # the worker's stop and a probe beside a command's exec

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
        self.waiting = collections.deque()  # type: collections.deque[tuple[socket.socket, object]]
        self.free = 0  # threads serving no connection, started or waiting for one
        self.handed = threading.Condition(self.conns_lock)
        super().__init__(address, Handler)
        agent.before_nested = self.keep_spare

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
        with self.conns_lock:
            self.waiting.append((request, client_address))
            self.handed.notify()
            short = len(self.waiting) - self.free
        for _ in range(short):
            self._start_thread()

    def keep_spare(self) -> None:
        """At least ``SPARE`` threads free, started now if need be."""
        with self.conns_lock:
            short = self.SPARE - (self.free - len(self.waiting))
        for _ in range(short):
            self._start_thread()

    def _start_thread(self) -> None:
        with self.conns_lock:
            self.free += 1
        threading.Thread(target=self._serve_connections, daemon=True).start()  # returns once it runs

    def _serve_connections(self) -> None:
        while True:
            with self.conns_lock:
                while not self.waiting:
                    self.handed.wait()
                request, client_address = self.waiting.popleft()
                self.free -= 1
            try:
                self.process_request_thread(request, client_address)
            finally:
                with self.conns_lock:
                    self.free += 1

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
    parser.add_argument(
        "--nest", action="store_true", help="root commands out of the agent's reach (nest.py)"
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
        layers = agent_layers.resolve(args.isolation, args.run_as, args.uid_pool, args.nest)
    except ValueError as exc:
        print(f"agent: {exc}"[:1000], file=sys.stderr)
        return 2
    spawn.new_session_keyring()  # nothing of the job's keyring for the commands
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
    agent.supervisors.warm()  # the supervisor server starts beside the agent, off the first exec's path
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
