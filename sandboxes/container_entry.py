"""The first process of a container sandbox: the gateway's forwarder, then the in-sandbox agent.

Standard library only, run by the image's own python3 from files mounted read-only beside it
(agent.py, supervisor.py, proctree.py, netns.py)::

    python3 container_entry.py [--forward PORT:SOCKET] AGENT-ARGS...

The container has no network but its loopback; ``--forward`` serves 127.0.0.1:PORT there by relaying each
connection to the gateway's Unix socket, mounted in (sandboxes/netns.py), so the harness's base URL is
the same as on the worker's host. Exits 3 with one line when this python cannot run the supervisor.
"""

from __future__ import annotations

import sys

MIN_PYTHON = (3, 11)  # the supervisor's


def main(argv: list[str]) -> int:
    if sys.version_info < MIN_PYTHON:
        found = ".".join(map(str, sys.version_info[:3]))
        print(f"the image's python3 is {found}; the sandbox supervisor needs >= 3.11", file=sys.stderr)
        return 3
    if argv[:1] == ["--forward"]:
        port, _, socket_path = argv[1].partition(":")
        import netns  # type: ignore[import-not-found]

        # The container's /proc is its own PID namespace's: the forwarder tells the harness's model
        # connections from the rest there.
        netns.start_forwarder(int(port), socket_path, bring_up_loopback=False, proc="/proc")
        argv = argv[2:]
    import agent  # type: ignore[import-not-found]

    return agent.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
