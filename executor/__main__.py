"""The ``rollout`` command. A ``run`` goes to the warm executor's pre-imported driver when there is one
that can take it (executor/driver_server.py); any other command, or a run it refused, runs in this
process. Nothing heavy is imported before that choice."""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        from executor.driver_server import hand_over

        code = hand_over(args)
        if code is not None:
            sys.exit(code)
    from executor.cli import app

    app(prog_name="rollout")


if __name__ == "__main__":
    main()
