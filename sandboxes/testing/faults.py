"""Fault injection at the provider seam, for the chaos suite: a provider whose starts fail on purpose."""

from __future__ import annotations

import math

from sandboxes.base import (
    CONTROL_SUFFIX,
    REVIEW_SUFFIX,
    Sandbox,
    SandboxProvider,
    SandboxSpec,
    SandboxStartError,
    StartsInMilliseconds,
)


def failures_in(starts: int, fraction: float) -> int:
    """How many of the first ``starts`` starts fail: spread evenly, exactly ``floor(starts * fraction)``."""
    return math.floor(starts * fraction + 1e-9)


class FlakyStartProvider:
    """Fails ``fraction`` of starts, spread evenly, before the inner provider is asked: nothing to leak.

    Counted rather than drawn, so a test knows the exact number of failures from the number of starts.
    Only the agents' sandboxes are counted and failed: a grading (or control) sandbox starts only after an
    agent ran, so counting it too would make the number of failures depend on how many agents finished.
    """

    def __init__(self, inner: SandboxProvider, fraction: float) -> None:
        self.inner = inner
        self.fraction = fraction
        self.name = inner.name
        self.isolation_label = inner.isolation_label
        if isinstance(inner, StartsInMilliseconds):  # a wrapper keeps what its provider can do
            self.starts_in_milliseconds = True
        self.starts = 0

    async def start(self, spec: SandboxSpec) -> Sandbox:
        if spec.session_id.endswith((REVIEW_SUFFIX, CONTROL_SUFFIX)):
            return await self.inner.start(spec)
        self.starts += 1
        if failures_in(self.starts, self.fraction) > failures_in(self.starts - 1, self.fraction):
            raise SandboxStartError(f"injected start failure for {spec.session_id}")
        return await self.inner.start(spec)

    async def aclose(self) -> None:
        """The inner provider's close (its spare server, the stops and removals under way)."""
        if (close := getattr(self.inner, "aclose", None)) is not None:
            await close()

    async def finish_removals(self) -> None:
        if (finish := getattr(self.inner, "finish_removals", None)) is not None:
            await finish()
