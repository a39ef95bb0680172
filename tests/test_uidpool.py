"""The uid pool's leases (sandboxes/uidpool.py), on a lock directory of the test's own: real files and
flocks, as a worker takes them."""

from __future__ import annotations

import fcntl
import os

import pytest

from sandboxes import uidpool


@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setattr(uidpool, "_cursor", [uidpool.POOL_BASE])
    return str(tmp_path / "uids")


def test_held_uids_are_never_handed_out_twice_and_a_lease_looks_past_its_last(pool):
    held = [uidpool.lease(pool) for _ in range(5)]
    assert len({lease.uid for lease in held}) == 5
    held[1].release()
    # Past the last lease, not back to the one just given back: the search does not walk the held ones.
    after = uidpool.lease(pool)
    assert after.uid == held[-1].uid + 1
    # Another process's lease (a lock this one does not hold) is passed over like its own.
    other = os.open(os.path.join(pool, str(after.uid + 1)), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)  # an open file description of its own: a lock apart
    try:
        assert uidpool.lease(pool).uid == after.uid + 2
    finally:
        os.close(other)


def test_the_search_goes_back_to_the_start_past_its_span_and_round_the_pool(pool):
    end = uidpool.POOL_BASE + uidpool.CURSOR_SPAN
    uidpool._cursor[0] = end - 1
    last = uidpool.lease(pool)
    assert last.uid == end - 1
    first = uidpool.lease(pool)
    assert first.uid == uidpool.POOL_BASE  # back at the start: the lock files stay few
    # The pool's last uid held: a search from there wraps round to the first free one.
    uidpool._cursor[0] = uidpool.POOL_BASE + uidpool.POOL_SIZE - 1
    tail = uidpool.lease(pool)
    assert tail.uid == uidpool.POOL_BASE + uidpool.POOL_SIZE - 1
    uidpool._cursor[0] = tail.uid
    assert uidpool.lease(pool).uid == uidpool.POOL_BASE + 1


def test_a_uid_whose_last_tenant_still_runs_is_passed_over(pool):
    lease = uidpool.lease(pool)
    busy = os.open(lease.busy_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(busy, fcntl.LOCK_SH)  # as its supervisor server holds it while a process is left
    try:
        lease.release()
        uidpool._cursor[0] = lease.uid
        assert uidpool.lease(pool).uid == lease.uid + 1
    finally:
        os.close(busy)
    uidpool._cursor[0] = lease.uid
    assert uidpool.lease(pool).uid == lease.uid


def test_the_account_files_follow_the_hosts_files_as_they_change(tmp_path):
    """A sandbox's passwd and group are the host's entries (but one of the pool's name) and its own; the
    host's are kept between sandboxes, and read again once the file has changed."""
    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text(f"root:x:0:0::/root:/bin/sh\n{uidpool.USER_NAME}:x:5:5::/:/bin/sh\n")
    group.write_text("root:x:0:\n")
    first = uidpool.account_files(70001, 70001, "/h", str(passwd), str(group))
    assert first[0].splitlines() == [
        "root:x:0:0::/root:/bin/sh",
        f"{uidpool.USER_NAME}:x:70001:70001:rollout sandbox:/h:/usr/sbin/nologin",
    ]
    assert first[1].splitlines() == ["root:x:0:", f"{uidpool.USER_NAME}:x:70001:"]
    with passwd.open("a") as f:  # an account added on the host meanwhile, within the same second
        f.write("dev:x:1000:1000::/home/dev:/bin/sh\n")
    second = uidpool.account_files(70002, 70002, "/h", str(passwd), str(group))
    assert "dev:x:1000:1000::/home/dev:/bin/sh" in second[0].splitlines()
    assert f"{uidpool.USER_NAME}:x:70002:70002:rollout sandbox:/h:/usr/sbin/nologin" in second[0]
    group.unlink()  # gone: no host entries, the sandbox's own still
    assert uidpool.account_files(70003, 70003, "/h", str(passwd), str(group))[1] == (
        f"{uidpool.USER_NAME}:x:70003:\n"
    )
