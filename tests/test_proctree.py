"""How a forked child of a sandbox's processes ends (sandboxes/proctree.end_child), and how they read and
write the kernel's small files (read_small, write_small)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from sandboxes import proctree


def _fork_and_end(body: Callable[[], int]) -> tuple[int, bytes]:
    """Fork a child that ends through end_child; its exit code and what it wrote on stderr."""
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(err_w, 2)
        proctree.end_child("test child", body)
    os.close(err_w)
    with os.fdopen(err_r, "rb") as err:
        said = err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), said


def test_a_child_exits_with_its_bodys_code_and_says_nothing() -> None:
    assert _fork_and_end(lambda: 7) == (7, b"")


@pytest.mark.parametrize("error", [RuntimeError("boom " * 1000), SystemExit(0), KeyboardInterrupt()])
def test_whatever_the_body_raises_ends_the_child_with_1_and_one_bounded_line(error: BaseException) -> None:
    def body() -> int:
        raise error

    code, said = _fork_and_end(body)
    assert code == 1
    assert said.startswith(f"test child: {type(error).__name__}".encode())
    assert said.endswith(b"\n") and said.count(b"\n") == 1
    assert len(said) <= proctree.CHILD_ERROR_CHARS + 1


def test_a_small_file_is_read_whole_up_to_its_bound_and_written_whole(tmp_path) -> None:
    path = tmp_path / "f"
    proctree.write_small(str(path), "x" * 70_000 + "é", create=True)  # more than one 64 KiB read
    assert proctree.read_small(str(path)) == "x" * 70_000 + "é"
    assert proctree.read_small(str(path), limit=5) == "xxxxx"
    proctree.write_small(str(path), "short", create=True)  # emptied first
    assert proctree.read_small(str(path)) == "short"
    # Without ``create``, only a file that is there: the kernel's files always are.
    with pytest.raises(FileNotFoundError):
        proctree.write_small(str(tmp_path / "absent"), "0")
    assert proctree.read_small(f"/proc/{os.getpid()}/stat").startswith(f"{os.getpid()} (")
