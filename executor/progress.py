"""Live progress: a rich display on a terminal, JSON lines elsewhere (CI, ``ray job submit``)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table


class Progress:
    def __init__(
        self, run_id: str, total: int | None, stream: TextIO | None = None, interval_s: float = 2.0
    ) -> None:
        self.run_id = run_id
        self.total = total  # (task, sample) pairs still to finish when the run started
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.rows = 0
        self.final = 0
        self.decisions: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.in_flight = 0
        self.waiting_retry = 0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._live: Live | None = None
        if self.stream.isatty():
            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=2)
            self._live.start()

    def record(self, decision: str, failure_kind: str, final: bool) -> None:
        self.rows += 1
        self.final += int(final)
        self.decisions[decision] += 1
        self.kinds[failure_kind] += 1

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._t0
        rate = self.final / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.final) if self.total is not None else None
        eta = left / rate if left and rate > 0 else None
        return {
            "run_id": self.run_id,
            "final": self.final,
            "total": self.total,
            "rows": self.rows,
            "in_flight": self.in_flight,
            "waiting_retry": self.waiting_retry,
            "per_s": round(rate, 3),
            "eta_s": round(eta, 1) if eta is not None else None,
            "decisions": dict(self.decisions),
            "failure_kinds": dict(self.kinds),
            "mask_rate": round(self.decisions["mask"] / self.final, 4) if self.final else 0.0,
        }

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.5 if self._live else self.interval_s):
            return
        self._last = now
        if self._live is not None:
            self._live.update(self._table())
        else:
            self.stream.write(json.dumps({"event": "progress", **self.snapshot()}) + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.tick(force=True)
        if self._live is not None:
            self._live.stop()

    def _table(self) -> Table:
        snap = self.snapshot()
        table = Table(title=f"run {self.run_id}", show_header=False)
        done = f"{snap['final']}/{snap['total']}" if snap["total"] is not None else str(snap["final"])
        table.add_row("final", done)
        table.add_row("in flight / waiting retry", f"{snap['in_flight']} / {snap['waiting_retry']}")
        table.add_row("rate", f"{snap['per_s']}/s  eta {snap['eta_s']}s")
        table.add_row("decisions", ", ".join(f"{k} {v}" for k, v in sorted(self.decisions.items())))
        table.add_row("failure kinds", ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())))
        return table
