"""Harness name -> adapter, with an error that lists the valid names."""

from __future__ import annotations

from collections.abc import Callable

from harnesses.base import Harness


def _codex(version: str | None) -> Harness:
    from harnesses.codex import CodexHarness

    return CodexHarness(version)


HARNESSES: dict[str, Callable[[str | None], Harness]] = {"codex": _codex}


def make_harness(name: str, version: str | None = None) -> Harness:
    try:
        factory = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    return factory(version)
