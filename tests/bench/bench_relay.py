"""The gateway's forwarder (sandboxes/netns.py) alone: small messages relayed one at a time between TCP
clients and a Unix socket, each answered before the next is sent (as a streamed answer's chunks cross
it one by one), and the forwarder's CPU for them. Prints its figures.

    python tests/bench/bench_relay.py --connections 4 --chunks 5000 --chunk-bytes 200

The upstream and the clients run in a child process, so this process's CPU is the forwarder's (its one
thread, and the threads it starts, if any) and nothing else's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile
import threading
import time

from sandboxes import netns


def _streams(port: int, path: str, connections: int, chunks: int, chunk_bytes: int) -> None:
    """Each connection: ``chunks`` rounds of one byte up and ``chunk_bytes`` down."""
    upstream = socket.socket(socket.AF_UNIX)
    upstream.connect(path)  # the forwarder's side was bound first; this tells the parent we are up
    upstream.close()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".up")
    listener.listen(connections)
    chunk = b"x" * chunk_bytes

    def serve_one() -> None:
        conn, _ = listener.accept()
        for _ in range(chunks):
            conn.recv(1)
            conn.sendall(chunk)
        conn.close()

    def read_one() -> None:
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(chunks):
            client.sendall(b"q")
            want = chunk_bytes
            while want > 0 and (data := client.recv(want)):
                want -= len(data)
        client.close()

    threads = [threading.Thread(target=f) for _ in range(connections) for f in (serve_one, read_one)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=5000)
    parser.add_argument("--chunk-bytes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-relay-")
    for _ in range(args.rounds):
        path = os.path.join(scratch, "gw.sock")
        ready = socket.socket(socket.AF_UNIX)
        ready.bind(path)
        ready.listen(1)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        netns.serve(listener, path + ".up")
        port = listener.getsockname()[1]
        child = multiprocessing.get_context("fork").Process(
            target=_streams, args=(port, path, args.connections, args.chunks, args.chunk_bytes)
        )
        cpu0, wall0 = time.process_time(), time.perf_counter()
        child.start()
        ready.accept()[0].close()
        child.join()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        listener.close()
        ready.close()
        for name in (path, path + ".up"):
            os.unlink(name)
        mb = args.connections * args.chunks * args.chunk_bytes / 1e6
        rounds = args.connections * args.chunks
        print(
            f"{args.connections} connections x {args.chunks} rounds (1 B up, {args.chunk_bytes} B down; "
            f"{mb:.1f} MB): forwarder CPU {cpu * 1000:.0f} ms ({cpu / rounds * 1e6:.1f} us a round), "
            f"wall {wall:.2f} s"
        )
    os.rmdir(scratch)


if __name__ == "__main__":
    main()
