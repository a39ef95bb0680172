"""What a sandbox's filesystem view costs the machine: ``--n`` views of a local sandbox's default steps
(``isolation.view`` as root's sandboxes have it: the system directories, /proc, /dev, /tmp and /dev/shm,
the interpreter and the harness cache read-only, its four writable directories, its passwd and group,
the sandbox root hidden) built by the native init's view mode (native_init.c), as a server builds one
for each sandbox, all held, then all let go. Prints the CPU per view of this process (the server's
part), of the builders, and of the machine (the kernel's workers too), for the build and the teardown.
Root only. Asserts nothing.

    .venv/bin/python tests/bench/bench_view_cpu.py [--n 300]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor.testing.bench_scale import _machine_cpu_s, _own_cpu_s  # noqa: E402
from sandboxes import fsview, isolation, native_init, supervisor_server, zygote  # noqa: E402
from sandboxes.cache_root import default_cache_root  # noqa: E402

SETTLE_S = 1.0  # after the last view is let go: the kernel's deferred teardown (its workers, RCU)


def _cpu() -> tuple[float, float, float]:
    """This process's CPU, its reaped children's, and the machine's, in seconds."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return _own_cpu_s(), children.ru_utime + children.ru_stime, _machine_cpu_s()


def _let_go(views: list[tuple[int, int]]) -> None:
    """Close each view's namespaces, and so end it (the last reference to each)."""
    while views:
        for fd in views.pop():
            os.close(fd)


def measure(n: int, scratch: Path) -> dict[str, float]:
    writable = [str(scratch / name) for name in ("work", "home", "tmp", "baseline.git")]
    for path in writable:
        os.mkdir(path)
    files = {f"/etc/{name}": str(scratch / name) for name in ("passwd", "group")}
    for source in files.values():
        Path(source).write_text("root:x:0:0::/:/bin/sh\n")
    layers = isolation.Isolation(pids=True, filesystem="mounts", user=True)
    # Hidden: the default sandbox root, inside the harness cache the view binds read-only (where the
    # machine has one: a step less where not).
    steps = isolation.view(layers, writable, [str(default_cache_root() / "sandboxes")], files=files)
    assert steps is not None
    base, proc = zygote._base_mounts(), fsview.detached_proc()
    if base is None:
        raise SystemExit("bench_view_cpu: no base mount namespace here (root only)")
    views: list[tuple[int, int]] = []
    try:
        before = _cpu()
        for _ in range(n):
            view = supervisor_server._build_view_natively(steps, base, fsview.clone_mount(proc))
            if view is None:
                raise SystemExit("bench_view_cpu: the native init could not build the view")
            views.append(view)
        while True:  # the builders, each gone once its view was opened
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        built = _cpu()
        _let_go(views)
        time.sleep(SETTLE_S)  # a fixed settling time for the kernel's deferred work, not a wait on us
        gone = _cpu()
    finally:
        _let_go(views)
        os.close(base)
        os.close(proc)
    return {
        "steps": len(steps),
        "build_server_ms": (built[0] - before[0]) / n * 1000,
        "build_builder_ms": (built[1] - before[1]) / n * 1000,
        "build_machine_ms": (built[2] - before[2]) / n * 1000,
        "teardown_server_ms": (gone[0] - built[0]) / n * 1000,
        "teardown_machine_ms": (gone[2] - built[2]) / n * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    if native_init.build() is None:
        raise SystemExit("bench_view_cpu: no native init (no C compiler)")
    scratch = Path(tempfile.mkdtemp(prefix="bench-view-cpu-", dir="/dev/shm"))
    try:
        f = measure(args.n, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{args.n} views of {f['steps']} steps: built, {f['build_builder_ms']:.2f} ms of the builder's CPU "
        f"and {f['build_server_ms']:.2f} ms of the server's a view ({f['build_machine_ms']:.2f} ms of the "
        f"machine's); let go, {f['teardown_server_ms']:.2f} ms of the server's "
        f"({f['teardown_machine_ms']:.2f} ms of the machine's, its other processes' over a second included)"
    )


if __name__ == "__main__":
    main()
