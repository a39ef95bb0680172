"""What a sandbox's commands may not do, by a seccomp filter the command's init installs before its exec,
which every process the command starts inherits and none can lift: take another process's descriptors
(``pidfd_getfd``) or write its memory (``process_vm_writev``), refused with EPERM; use the kernel's
keyrings (``add_key``, ``request_key``, ``keyctl``), refused with ENOSYS, as on a kernel built without
them.

A sandbox's processes share one user, and the kernel lets a process of a user do both to another of the
same user where it would let it trace it. The harness's connections to the gateway are its own
(sandboxes/netns.py): a tool the agent runs must not take one over, nor steer the harness's own
process into opening one for it. Tracing itself (``ptrace``: gdb, strace, LeakSanitizer) is left alone,
as is ``/proc/PID/mem``, which no filter can tell from another file: docs/configuration.md says so.

The keyrings are the kernel's, not a namespace's: a uid's user keyrings outlive its processes, and the
pool gives a uid to sandbox after sandbox (uidpool.py), so a key one tenant stored would wait there for
the next. Refused, no sandbox stores one, and none is made for a sandbox at all: each key the kernel
frees costs a walk of every key on the host (its garbage collector), and a uid's keyrings, once made,
stay for good (three for every uid the pool ever leased, ~12,000 on a host after a few days of runs:
~1.5 ms of the kernel's CPU a session at 1,000 in flight). Container runtimes refuse the same three
calls by default.

Standard library only: it ships beside spawn.py (sandboxes/remote.py's AGENT_IMPORTS).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# BPF: load a word of the call's data, jump if equal to k, return k.
_LD_ABS = 0x20
_JEQ = 0x15
_RET = 0x06
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data
_X32 = 0x40000000

# Per machine: its own calling convention's numbers, and those of another one its kernel also runs
# (x86-64 runs i386 and x32 calls, each with numbers of its own), each (arch, {number: errno}) as the
# kernel's audit arch names them: pidfd_getfd and process_vm_writev refused, add_key, request_key and
# keyctl not there.
_TAKING_OVER, _KEYRINGS = errno.EPERM, errno.ENOSYS


def _refused(taking_over: list[int], keyrings: list[int]) -> dict[int, int]:
    return {**dict.fromkeys(taking_over, _TAKING_OVER), **dict.fromkeys(keyrings, _KEYRINGS)}


_FORBIDDEN: dict[str, list[tuple[int, dict[int, int]]]] = {
    "x86_64": [
        (
            0xC000003E,
            _refused([438, 311, _X32 | 438, _X32 | 540], [248, 249, 250, _X32 | 248, _X32 | 249, _X32 | 250]),
        ),
        (0x40000003, _refused([438, 348], [286, 287, 288])),
    ],
    "aarch64": [  # its own, and arm32's
        (0xC00000B7, _refused([438, 271], [217, 218, 219])),
        (0x40000028, _refused([438, 377], [309, 310, 311])),
    ],
}  # fmt: skip


# prlimit64, per machine as above. A nested root command (nest.py) shares root's uid with the agent's
# processes, and the kernel lets a process set the limits of another of its uid (an agent left with 3
# descriptors, or 20 MB of address space, fails its next request): for it, prlimit64 with any pid but 0
# (the caller itself, as glibc's setrlimit and getrlimit pass it) is refused with EPERM, ``prlimit --pid
# $$`` too. A sandbox user's commands share their uid only with their own sandbox: theirs is left alone.
_PRLIMIT64: dict[str, dict[int, list[int]]] = {
    "x86_64": {0xC000003E: [302, _X32 | 302], 0x40000003: [340]},
    "aarch64": {0xC00000B7: [261], 0x40000028: [369]},
}
_OTHER_PID = -1  # in place of an errno: refused with EPERM unless the call's first argument is 0
_ARG0 = 16  # the low word of args[0] in struct seccomp_data (little-endian machines, as both are)


def _program(arches: list[tuple[int, dict[int, int]]]) -> list[tuple[int, int, int, int]]:
    """The filter: for each arch, its numbers refused, each with its errno (``_OTHER_PID``: unless its
    first argument is 0); any other call allowed, and so is a call of an arch that is none of these (no
    process of this machine makes one)."""
    ops: list[tuple[int, int, int, int]] = []
    to_refuse: list[tuple[int, int]] = []  # (the test that jumps to a refusal, its errno), once placed
    for arch, numbers in arches:
        ops.append((_LD_ABS, 0, 0, _ARCH))
        test = len(ops)
        ops.append((_JEQ, 0, 0, arch))  # its false branch set below: past this arch's block
        ops.append((_LD_ABS, 0, 0, _NR))
        for number, err in numbers.items():
            to_refuse.append((len(ops), err))
            ops.append((_JEQ, 0, 0, number))
        ops.append((_RET, 0, 0, _RET_ALLOW))
        ops[test] = (_JEQ, 0, len(ops) - test - 1, arch)
    ops.append((_RET, 0, 0, _RET_ALLOW))
    refusals = {}
    for err in sorted({err for _, err in to_refuse}):
        refusals[err] = len(ops)
        if err == _OTHER_PID:  # the pid 0 allowed (the next but one), any other refused (the last)
            ops += [(_LD_ABS, 0, 0, _ARG0), (_JEQ, 0, 1, 0), (_RET, 0, 0, _RET_ALLOW)]
            err = errno.EPERM
        ops.append((_RET, 0, 0, _RET_ERRNO | err))
    for at, err in to_refuse:  # jumps are relative to the next instruction
        code, _jt, jf, k = ops[at]
        ops[at] = (code, refusals[err] - at - 1, jf, k)
    return ops


def _packed(program: list[tuple[int, int, int, int]]) -> bytes:
    return b"".join(struct.pack("=HBBI", *op) for op in program)


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _made(packed: bytes | None) -> tuple[_Fprog, ctypes.Array[ctypes.c_char]] | None:
    if packed is None:
        return None
    code = ctypes.create_string_buffer(packed)
    return _Fprog(len(packed) // _OP_BYTES, ctypes.addressof(code)), code  # the buffer lives as the header


_OP_BYTES = struct.calcsize("=HBBI")
_ARCHES = _FORBIDDEN.get(os.uname().machine)
_PACKED = _packed(_program(_ARCHES)) if _ARCHES is not None else None
# A nested root command's: the same, and prlimit64 on another process.
_NESTED = [
    (arch, {**numbers, **dict.fromkeys(_PRLIMIT64[os.uname().machine][arch], _OTHER_PID)})
    for arch, numbers in _ARCHES or ()
]
# The same filter for the native init (native_init.c), which installs it from its argument: None on a
# machine this does not know.
FILTER_HEX = _PACKED.hex() if _PACKED is not None else None
# Made once, at import (the fork server's: every command's init is forked from it), not in each init: a
# ctypes structure class made and a libc loaded cost an init ~0.5 ms and ~150 pages copied.
_FILTER = _made(_PACKED)
_NESTED_FILTER = _made(_packed(_program(_NESTED))) if _NESTED else None
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here too: a child would resolve it again


def install() -> None:
    """In a process about to exec a command (no_new_privs set): refuse ``pidfd_getfd``,
    ``process_vm_writev`` and the keyrings' calls to it and all it starts. Nothing on a machine this does
    not know. Raises OSError where the kernel refuses the filter."""
    _load(_FILTER)


def install_nested() -> None:
    """As ``install``, for a nested root command (nest.py; CAP_SYS_ADMIN in its own user namespace lets
    the filter in without no_new_privs): ``prlimit64`` on another process refused too."""
    _load(_NESTED_FILTER)


def _load(made: tuple[_Fprog, ctypes.Array[ctypes.c_char]] | None) -> None:
    if made is None:
        return
    if _PRCTL(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(made[0]), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)}")
