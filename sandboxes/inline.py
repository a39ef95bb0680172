"""Small file work on the event loop, large in a thread.

A hop to a thread and back costs more than reading or writing a few dozen kilobytes, and in a Ray worker,
whose other threads want the GIL too, several milliseconds. A session makes a dozen such small steps
(configs, result files, a harness's output, a request body's kept copy), so they run inline; anything
larger goes to a thread, so that one big file never stalls the worker's other sessions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

INLINE_BYTES = 64 * 1024

T = TypeVar("T")


async def small_inline(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, which handles about ``size`` bytes: here when that is little, else in a thread."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
