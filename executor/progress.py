"""Live progress: a rich display on a terminal, JSON lines elsewhere (CI, ``ray job submit``).

The driver calls ``record`` once per row and ``tick`` once per loop turn. ``record`` only bumps
counters. On a terminal, ``tick`` publishes an immutable snapshot (a fresh dict) at most every
``FRAME_S``, and rich's refresh thread draws it: a frame of tables costs tens of milliseconds of CPU,
which must not sit in the driver's loop between two ``ray.wait`` calls, and the refresh thread never
reads counters the driver is changing. Off a terminal, ``tick`` writes one JSON line every
``interval_s``. ``tests/test_progress.py`` prints what each costs.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

FRAME_S = 0.5
REFRESH_PER_S = 1.0
MAX_GROUPS_SHOWN = 12  # harness x provider rows on screen; the JSON line carries all of them


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _counts(counter: Counter[str]) -> str:
    return "  ".join(f"{k} {v}" for k, v in counter.most_common()) or "-"


class Progress:
    def __init__(
        self,
        run_id: str,
        total: int | None,
        stream: TextIO | None = None,
        interval_s: float = 2.0,
        live: bool | None = None,
    ) -> None:
        self.run_id = run_id
        self.total = total  # (task, sample) pairs still to finish when the run started
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.rows = 0
        self.final = 0
        self.masked = 0
        self.decisions: Counter[str] = Counter()  # every row: accept / mask / retry
        self.kinds: Counter[str] = Counter()  # every row, retried attempts included
        self.statuses: Counter[str] = Counter()  # final rows only
        self.groups: dict[tuple[str, str], Counter[str]] = {}  # (harness, provider) -> decision counts
        self.in_flight = 0
        self.waiting_retry = 0
        # What keeps the run's workers from running, when something does (executor/capacity.py).
        self.cluster: str | None = None
        self._t0 = time.monotonic()
        self._last = float("-inf")  # the first tick always renders
        self._live: Live | None = None
        self._shown = self.snapshot()  # what the refresh thread draws; replaced whole, never mutated
        if live if live is not None else self.stream.isatty():
            console = Console(file=self.stream, force_terminal=True) if live else Console(file=self.stream)
            self._live = Live(
                console=console,
                get_renderable=lambda: render(self._shown),
                refresh_per_second=REFRESH_PER_S,
                transient=False,
            )
            self._live.start()

    def record(
        self,
        decision: str,
        failure_kind: str,
        final: bool,
        *,
        status: str | None = None,
        harness: str | None = None,
        provider: str | None = None,
    ) -> None:
        self.rows += 1
        self.decisions[decision] += 1
        self.kinds[failure_kind] += 1
        if final:
            self.final += 1
            self.masked += decision == "mask"
            if status:
                self.statuses[status] += 1
        key = (harness or "?", provider or "?")
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Counter()
        group[decision] += 1

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._t0
        rate = self.final / elapsed if elapsed > 0 else 0.0
        left = max(self.total - self.final, 0) if self.total is not None else None
        eta = left / rate if left and rate > 0 else (0.0 if left == 0 else None)
        queued = (
            max(self.total - self.final - self.in_flight - self.waiting_retry, 0)
            if self.total is not None
            else None
        )
        return {
            "run_id": self.run_id,
            "final": self.final,
            "total": self.total,
            "rows": self.rows,
            "in_flight": self.in_flight,
            "waiting_retry": self.waiting_retry,
            "queued": queued,
            "cluster": self.cluster,
            "elapsed_s": round(elapsed, 1),
            "per_s": round(rate, 3),
            "eta_s": round(eta, 1) if eta is not None else None,
            "decisions": dict(self.decisions),
            "statuses": dict(self.statuses),
            "failure_kinds": dict(self.kinds),
            "masked": self.masked,
            "mask_rate": round(self.masked / self.final, 4) if self.final else 0.0,
            "groups": [{"harness": h, "provider": p, **dict(c)} for (h, p), c in sorted(self.groups.items())],
        }

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (FRAME_S if self._live else self.interval_s):
            return
        self._last = now
        if self._live is not None:
            self._shown = self.snapshot()
        else:
            self.stream.write(json.dumps({"event": "progress", **self.snapshot()}) + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.tick(force=True)
        if self._live is not None:
            self._live.stop()  # draws the last frame


def render(snap: dict[str, Any]) -> Group:
    """One frame of the terminal display, from a snapshot alone."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    total = snap["total"]
    done = f"{snap['final']}/{total}" if total is not None else str(snap["final"])
    head.add_row(
        f"run {snap['run_id']}", ProgressBar(total=max(total or 1, 1), completed=snap["final"], width=40)
    )
    queued = snap["queued"] if snap["queued"] is not None else "-"
    head.add_row(
        "done",
        f"{done}   in flight {snap['in_flight']}   waiting retry {snap['waiting_retry']}   queued {queued}",
    )
    head.add_row(
        "rate",
        f"{snap['per_s']:.3f}/s   ETA {_duration(snap['eta_s'])}   elapsed {_duration(snap['elapsed_s'])}",
    )
    if snap.get("cluster"):
        head.add_row("cluster", Text(snap["cluster"], style="bold red"))
    mask = Text(f"{snap['mask_rate']:.1%}", style="bold red" if snap["masked"] else "")
    head.add_row("mask rate", Text.assemble(mask, f"   ({snap['masked']} of {snap['final']} final rows)"))
    head.add_row("status", _counts(Counter(snap["statuses"])))
    head.add_row("decision", _counts(Counter(snap["decisions"])))
    kinds = Counter({k: v for k, v in snap["failure_kinds"].items() if k != "none"})
    head.add_row("failure kind", _counts(kinds))
    if not snap["groups"]:
        return Group(head)
    groups = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for name in ("harness", "provider", "accept", "mask", "retry", "mask rate"):
        groups.add_column(name, justify="left" if name in ("harness", "provider") else "right")
    ranked = sorted(
        snap["groups"], key=lambda g: -(g.get("accept", 0) + g.get("mask", 0) + g.get("retry", 0))
    )
    for g in ranked[:MAX_GROUPS_SHOWN]:
        accept, masked, retry = g.get("accept", 0), g.get("mask", 0), g.get("retry", 0)
        rate = f"{masked / (accept + masked):.1%}" if accept + masked else "-"
        groups.add_row(g["harness"], g["provider"], str(accept), str(masked), str(retry), rate)
    if len(ranked) > MAX_GROUPS_SHOWN:
        groups.add_row(f"... {len(ranked) - MAX_GROUPS_SHOWN} more", "", "", "", "", "")
    return Group(head, Text(""), groups)
