"""What a sandbox's commands may not do to each other's processes: take another process's descriptors
(``pidfd_getfd``) or write its memory (``process_vm_writev``), by a seccomp filter the command's init
installs before its exec, which every process the command starts inherits and none can lift.

A sandbox's processes share one user, and the kernel lets a process of a user do both to another of the
same user where it would let it trace it. The harness's connections to the gateway are its own
(sandboxes/netns.py): a tool the agent runs must not take one over, nor steer the harness's own
process into opening one for it. Tracing itself (``ptrace``: gdb, strace, LeakSanitizer) is left alone,
as is ``/proc/PID/mem``, which no filter can tell from another file: docs/configuration.md says so.

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
# (x86-64 runs i386 and x32 calls, each with numbers of its own), each (arch, [pidfd_getfd,
# process_vm_writev]) as the kernel's audit arch names them.
_FORBIDDEN: dict[str, list[tuple[int, list[int]]]] = {
    "x86_64": [(0xC000003E, [438, 311, _X32 | 438, _X32 | 540]), (0x40000003, [438, 348])],
    "aarch64": [(0xC00000B7, [438, 271]), (0x40000028, [438, 377])],  # its own, and arm32's
}


def _program(arches: list[tuple[int, list[int]]]) -> list[tuple[int, int, int, int]]:
    """The filter: for each arch, its numbers refused with EPERM; any other call allowed, and so is a
    call of an arch that is none of these (no process of this machine makes one)."""
    ops: list[tuple[int, int, int, int]] = []
    to_deny: list[int] = []  # the tests that jump to the refusal, once its place is known
    for arch, numbers in arches:
        ops.append((_LD_ABS, 0, 0, _ARCH))
        test = len(ops)
        ops.append((_JEQ, 0, 0, arch))  # its false branch set below: past this arch's block
        ops.append((_LD_ABS, 0, 0, _NR))
        for number in numbers:
            to_deny.append(len(ops))
            ops.append((_JEQ, 0, 0, number))
        ops.append((_RET, 0, 0, _RET_ALLOW))
        ops[test] = (_JEQ, 0, len(ops) - test - 1, arch)
    ops.append((_RET, 0, 0, _RET_ALLOW))
    deny = len(ops)
    ops.append((_RET, 0, 0, _RET_ERRNO | errno.EPERM))
    for at in to_deny:  # jumps are relative to the next instruction
        code, _jt, jf, k = ops[at]
        ops[at] = (code, deny - at - 1, jf, k)
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
# The same filter for the native init (native_init.c), which installs it from its argument: None on a
# machine this does not know.
FILTER_HEX = _PACKED.hex() if _PACKED is not None else None
# Made once, at import (the fork server's: every command's init is forked from it), not in each init: a
# ctypes structure class made and a libc loaded cost an init ~0.5 ms and ~150 pages copied.
_FILTER = _made(_PACKED)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here too: a child would resolve it again


def forbid_taking_over() -> None:
    """In a process about to exec a command (no_new_privs set): refuse ``pidfd_getfd`` and
    ``process_vm_writev`` to it and all it starts. Nothing on a machine this does not know. Raises
    OSError where the kernel refuses the filter."""
    if _FILTER is None:
        return
    if _PRCTL(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(_FILTER[0]), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)}")
