"""Small file work on the event loop, large in a thread.

A hop to a thread and back costs more than reading or writing a few dozen kilobytes, and in a Ray worker,
whose other threads want the GIL too, several milliseconds. A session makes a dozen such small steps
(configs, result files, a harness's output and the parse of its record, a request body's kept copy, a
prepared workspace's copy, the evidence's compression, the row's conversion), so they run inline; anything
larger goes to a thread, so that one big file, tree or record never stalls the worker's other sessions.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TypeVar

INLINE_BYTES = 64 * 1024
INLINE_ENTRIES = 64  # a directory tree with fewer entries than this counts as small

T = TypeVar("T")


async def inline_if(small: bool, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: here when ``small``, else in a thread."""
    if small:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def small_inline(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, which handles about ``size`` bytes: here when that is little, else in a thread."""
    return await inline_if(size <= INLINE_BYTES, fn, *args)


def small_tree(root: str | os.PathLike[str]) -> bool:
    """Whether the tree under ``root`` holds fewer than ``INLINE_ENTRIES`` entries; stops counting there."""
    count, pending = 0, [os.fspath(root)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                count += 1
                if count >= INLINE_ENTRIES:
                    return False
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return True
