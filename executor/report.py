"""``rollout report``: one self-contained HTML file with the run's plots, drawn as inline SVG.

Nothing is fetched at view time (no CDN, no font, no script from elsewhere): the plots are SVG written
here, and the only script is a few lines that, once the page is laid out, count each plot's drawn marks
into a ``data-drawn`` attribute (the Chromium test reads it back from the DOM). Every mark carries an
SVG ``<title>``, so hovering shows its exact value without any script.
"""

from __future__ import annotations

import html
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.export import run_config
from executor.row import columns
from executor.status import status_data
from executor.storage import Location, Where, locate
from executor.store import read_table
from executor.tasks import InputError

PLOTS = ("outcomes", "phases", "attempts", "latency", "tokens", "reward")
MAX_BARS = 40  # per plot: more tasks than this show the top ones and say so
WIDTH = 820
LABEL_W = 200
ROW_H = 22
PHASES = (("setup", "#8da0cb"), ("agent", "#4c72b0"), ("verify", "#55a868"), ("cleanup", "#c9c9c9"))
PALETTE = (
    "#4c72b0",
    "#dd8452",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
    "#a1c9f4",
    "#ffb482",
    "#d0bbff",
)
_COLUMNS = list(columns("report"))

Fmt = Callable[[float], str]


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value == int(value):
        return str(int(value))
    return f"{value:.3g}"


def _secs(value: float) -> str:
    return f"{value:.3g}s" if value < 100 else f"{value:.0f}s"


def _nice_step(top: float, ticks: int = 5, integer: bool = False) -> float:
    raw = max(top, 1e-9) / ticks
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 2.5, 5, 10):
        step = mult * power
        if step >= raw and (not integer or step == int(step)):
            return step
    return max(10 * power, 1.0) if integer else 10 * power


def _axis_ticks(top: float, integer: bool = False) -> list[float]:
    step = _nice_step(top, integer=integer)
    count = min(math.ceil(top / step - 1e-9), 10)
    return [step * i for i in range(count + 1)] if top > 0 else [0.0]


def _color_for(name: str) -> str:
    if name.startswith("none"):
        return "#55a868"
    return PALETTE[sum(name.encode()) % len(PALETTE)]


@dataclass
class Plot:
    key: str
    title: str
    caption: str
    svg: str


def _svg_open(key: str, height: int, title: str) -> str:
    return (
        f'<svg class="plot" data-plot="{key}" role="img" aria-label="{_esc(title)}" '
        f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg">'
    )


def _legend(items: Sequence[tuple[str, str]], y: int) -> tuple[str, int]:
    """Legend swatches wrapped over as many lines as needed; returns the SVG and the height used."""
    parts, x, line = [], LABEL_W, 0
    for name, color in items:
        w = 18 + 7 * len(name) + 14
        if x + w > WIDTH - 10 and x > LABEL_W:
            x, line = LABEL_W, line + 1
        yy = y + line * 18
        parts.append(
            f'<rect x="{x}" y="{yy}" width="12" height="12" fill="{color}"/>'
            f'<text x="{x + 16}" y="{yy + 10}" class="legend">{_esc(name)}</text>'
        )
        x += w
    return "".join(parts), (line + 1) * 18 if items else 0


def _empty(key: str, title: str, why: str) -> Plot:
    svg = _svg_open(key, 40, title) + f'<text x="10" y="24" class="empty">{_esc(why)}</text></svg>'
    return Plot(key, title, why, svg)


def hbars(
    key: str,
    title: str,
    caption: str,
    labels: list[str],
    series: list[tuple[str, list[float], str]],
    fmt: Fmt = _num,
    notes: list[str] | None = None,
    integer: bool = False,
) -> Plot:
    """Horizontal bars, one per label, stacked over ``series`` (name, value per label, colour)."""
    if not labels or not any(v for _, values, _ in series for v in values):
        return _empty(key, title, "no data")
    totals = [sum(values[i] for _, values, _ in series) for i in range(len(labels))]
    ticks = _axis_ticks(max(totals), integer=integer)
    top = ticks[-1] or 1.0
    plot_w = WIDTH - LABEL_W - 70
    axis_y = 8 + ROW_H * len(labels)
    legend, legend_h = _legend([(n, c) for n, _, c in series] if len(series) > 1 else [], axis_y + 26)
    height = axis_y + 24 + legend_h + 6
    out = [_svg_open(key, height, title)]
    for t in ticks:
        x = LABEL_W + plot_w * t / top
        out.append(
            f'<line x1="{x:.1f}" y1="4" x2="{x:.1f}" y2="{axis_y}" class="grid"/>'
            f'<text x="{x:.1f}" y="{axis_y + 14}" class="tick" text-anchor="middle">{_esc(fmt(t))}</text>'
        )
    for i, label in enumerate(labels):
        y = 8 + ROW_H * i
        shown = label if len(label) <= 28 else label[:27] + "…"
        out.append(
            f'<text x="{LABEL_W - 6}" y="{y + ROW_H * 0.65:.1f}" class="label" text-anchor="end">'
            f"<title>{_esc(label)}</title>{_esc(shown)}</text>"
        )
        x = float(LABEL_W)
        for name, values, color in series:
            v = values[i]
            if not v:
                continue
            w = max(plot_w * v / top, 1.0)
            out.append(
                f'<rect class="mark" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 6}" '
                f'fill="{color}">'
                f"<title>{_esc(label)} · {_esc(name)}: {_esc(fmt(v))}</title></rect>"
            )
            x += w
        note = notes[i] if notes else fmt(totals[i])
        out.append(f'<text x="{x + 4:.1f}" y="{y + ROW_H * 0.65:.1f}" class="value">{_esc(note)}</text>')
    out.append(legend)
    out.append("</svg>")
    return Plot(key, title, caption, "".join(out))


def vbars(
    key: str,
    title: str,
    caption: str,
    categories: list[str],
    series: list[tuple[str, list[float], str]],
    xlabel: str,
    ylabel: str,
) -> Plot:
    """Vertical bars per category, grouped side by side over ``series``."""
    if not categories or not any(v for _, values, _ in series for v in values):
        return _empty(key, title, "no data")
    ticks = _axis_ticks(max(v for _, values, _ in series for v in values), integer=True)
    top = ticks[-1] or 1.0
    left, plot_h, base = 60, 200, 220
    plot_w = WIDTH - left - 20
    slot = plot_w / len(categories)
    bar_w = max(min(slot * 0.8 / len(series), 40.0), 1.0)
    legend, legend_h = _legend([(n, c) for n, _, c in series] if len(series) > 1 else [], base + 44)
    height = base + 50 + legend_h
    out = [_svg_open(key, height, title)]
    for t in ticks:
        y = base - plot_h * t / top
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{WIDTH - 20}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_esc(_num(t))}</text>'
        )
    every = max(1, math.ceil(len(categories) / 16))  # keep category labels from overlapping
    for i, cat in enumerate(categories):
        x0 = left + slot * i + (slot - bar_w * len(series)) / 2
        for j, (name, values, color) in enumerate(series):
            v = values[i]
            if not v:
                continue
            h = max(plot_h * v / top, 1.0)
            out.append(
                f'<rect class="mark" x="{x0 + j * bar_w:.1f}" y="{base - h:.1f}" width="{bar_w:.1f}" '
                f'height="{h:.1f}" fill="{color}">'
                f"<title>{_esc(name)} {_esc(cat)}: {_esc(_num(v))}</title></rect>"
            )
        if i % every == 0:
            out.append(
                f'<text x="{left + slot * (i + 0.5):.1f}" y="{base + 14}" class="tick" '
                f'text-anchor="middle">{_esc(cat)}</text>'
            )
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{base + 32}" class="axis" text-anchor="middle">')
    out.append(f"{_esc(xlabel)}</text>")
    out.append(f'<text x="14" y="{base - plot_h / 2:.1f}" class="axis" text-anchor="middle" ')
    out.append(f'transform="rotate(-90 14 {base - plot_h / 2:.1f})">{_esc(ylabel)}</text>')
    out.append(legend)
    out.append("</svg>")
    return Plot(key, title, caption, "".join(out))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _top_tasks(
    rows: list[dict[str, Any]], weight: Callable[[dict[str, Any]], float]
) -> tuple[list[str], str]:
    per: dict[str, float] = defaultdict(float)
    for r in rows:
        per[r["task_id"]] += weight(r)
    ordered = sorted(per, key=lambda t: (-per[t], t))
    note = f" Showing {MAX_BARS} of {len(ordered)} tasks." if len(ordered) > MAX_BARS else ""
    return ordered[:MAX_BARS], note


def outcome_plot(rows: list[dict[str, Any]]) -> Plot:
    finals = [r for r in rows if r["final"]]
    groups = sorted({(r["harness"] or "?", r["sandbox_provider"] or "?") for r in finals})
    kinds = Counter(f"{r['failure_kind']} → {r['decision']}" for r in finals)
    names = sorted(kinds, key=lambda k: (not k.startswith("none"), -kinds[k], k))
    counts = Counter(
        (r["harness"] or "?", r["sandbox_provider"] or "?", f"{r['failure_kind']} → {r['decision']}")
        for r in finals
    )
    series = [(n, [float(counts[(h, p, n)]) for h, p in groups], _color_for(n)) for n in names]
    return hbars(
        "outcomes",
        "Outcome mix per harness and provider",
        "Final rows by failure kind and decision (accept: trainable; mask: kept as evidence only).",
        [f"{h} · {p}" for h, p in groups],
        series,
        integer=True,
    )


def phase_plot(rows: list[dict[str, Any]]) -> Plot:
    timed = [r for r in rows if r["t_total_s"] is not None]
    tasks, note = _top_tasks(timed, lambda r: r["t_total_s"] or 0.0)
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in timed:
        by_task[r["task_id"]].append(r)
    series = [
        (phase, [_mean([r[f"t_{phase}_s"] or 0.0 for r in by_task[t]]) for t in tasks], color)
        for phase, color in PHASES
    ]
    return hbars(
        "phases",
        "Duration by phase",
        "Mean seconds per attempt for each task, split into setup, agent, verify and cleanup." + note,
        tasks,
        series,
        fmt=_secs,
    )


def attempts_plot(rows: list[dict[str, Any]]) -> Plot:
    last: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r["task_id"], r["sample_index"])
        last[key] = max(last.get(key, 0), r["attempt"])
    hist = Counter(last.values())
    cats = list(range(1, max(hist, default=0) + 1))
    return vbars(
        "attempts",
        "Attempts per rollout",
        "How many attempts each (task, sample) took; more than one means it was retried.",
        [str(c) for c in cats],
        [("rollouts", [float(hist[c]) for c in cats], "#4c72b0")],
        "attempts",
        "rollouts",
    )


def latency_plot(rows: list[dict[str, Any]]) -> Plot:
    lat = [c["latency_s"] for r in rows for c in r["model_calls"] or [] if c["latency_s"] is not None]
    ttfb = [c["ttfb_s"] for r in rows for c in r["model_calls"] or [] if c["ttfb_s"] is not None]
    if not lat:
        return _empty("latency", "Model latency and time to first byte", "no model calls recorded")
    lo = max(min(lat + ttfb), 1e-4)
    hi = max(lat + ttfb) * 1.0001
    bins = 18
    ratio = (hi / lo) ** (1 / bins) if hi > lo else 2.0
    edges = [lo * ratio**i for i in range(bins + 1)]

    def hist(values: list[float]) -> list[float]:
        counts = [0.0] * bins
        for v in values:
            i = min(int(math.log(max(v, lo) / lo, ratio)), bins - 1) if hi > lo else 0
            counts[i] += 1
        return counts

    def stats(values: list[float]) -> str:
        if not values:
            return "none"
        return f"p50 {_secs(_pct(values, 0.5))}, p90 {_secs(_pct(values, 0.9))}, max {_secs(max(values))}"

    return vbars(
        "latency",
        "Model latency and time to first byte",
        f"Every upstream attempt the gateway recorded ({len(lat)}), log-spaced bins. "
        f"Latency: {stats(lat)}. Time to first byte: {stats(ttfb)}.",
        [_secs(edges[i]) for i in range(bins)],
        [("latency", hist(lat), "#4c72b0"), ("time to first byte", hist(ttfb), "#dd8452")],
        "seconds (bin start)",
        "attempts",
    )


def token_plot(rows: list[dict[str, Any]]) -> Plot:
    known = [r for r in rows if r["input_tokens"] is not None or r["output_tokens"] is not None]
    if not known:
        return _empty("tokens", "Token usage", "no token counts recorded")
    tasks, note = _top_tasks(known, lambda r: (r["input_tokens"] or 0) + (r["output_tokens"] or 0))
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in known:
        by_task[r["task_id"]].append(r)
    ins = [_mean([r["input_tokens"] or 0 for r in by_task[t]]) for t in tasks]
    outs = [_mean([r["output_tokens"] or 0 for r in by_task[t]]) for t in tasks]
    total_in = sum(r["input_tokens"] or 0 for r in known)
    total_out = sum(r["output_tokens"] or 0 for r in known)
    return hbars(
        "tokens",
        "Token usage",
        f"Mean tokens per attempt by task, as the endpoint reported them to the gateway "
        f"(run total: {_num(total_in)} input, {_num(total_out)} output)." + note,
        tasks,
        [("input", ins, "#64b5cd"), ("output", outs, "#dd8452")],
        notes=[f"{_num(i)} in / {_num(o)} out" for i, o in zip(ins, outs, strict=True)],
    )


def reward_plot(rows: list[dict[str, Any]]) -> Plot:
    accepted = [r for r in rows if r["final"] and r["decision"] == "accept" and r["reward"] is not None]
    masked = Counter(r["task_id"] for r in rows if r["final"] and r["decision"] == "mask")
    if not accepted:
        return _empty("reward", "Reward by task", "no accepted, graded rows yet")
    tasks = sorted({r["task_id"] for r in accepted} | set(masked))[:MAX_BARS]
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in accepted:
        by_task[r["task_id"]].append(r["reward"])
    means = [_mean(by_task[t]) for t in tasks]
    notes = [
        (f"{m:.2f} (n={len(by_task[t])})" if by_task[t] else "no reward")
        + (f", {masked[t]} masked" if masked[t] else "")
        for t, m in zip(tasks, means, strict=True)
    ]
    return hbars(
        "reward",
        "Reward by task",
        "Mean reward of the final accepted rows; masked rows carry no reward and are counted beside.",
        tasks,
        [("mean reward", means, "#55a868")],
        fmt=lambda v: f"{v:.2g}",
        notes=notes,
    )


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:880px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 2px} .sub{color:#666;margin:0 0 14px}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:6px 12px;min-width:92px}
.card b{display:block;font-size:18px} .card span{color:#666;font-size:12px}
.caption{color:#555;margin:0 0 6px;font-size:13px}
svg.plot{display:block;margin:4px 0 8px} svg text{font:11px system-ui,sans-serif;fill:#333}
svg .grid{stroke:#e6e6e6} svg .value,svg .tick{fill:#666} svg .empty{fill:#999;font-size:13px}
svg .axis{fill:#555;font-size:12px}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#555} td.n{text-align:right}
"""
# Counts, after layout, the marks each plot actually drew: the headless-browser test reads the result.
_SCRIPT = """
window.addEventListener('load', function () {
  document.querySelectorAll('svg.plot').forEach(function (svg) {
    var drawn = 0;
    svg.querySelectorAll('.mark').forEach(function (m) {
      var b = m.getBBox(); if (b.width > 0 && b.height > 0) { drawn += 1; }
    });
    svg.setAttribute('data-drawn', String(drawn));
  });
  document.body.setAttribute('data-rendered', 'yes');
});
"""


def _table(headers: list[str], rows: list[list[Any]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=n' if i in numeric else ''}>{_esc(c)}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def build_plots(rows: list[dict[str, Any]]) -> list[Plot]:
    return [
        outcome_plot(rows),
        phase_plot(rows),
        attempts_plot(rows),
        latency_plot(rows),
        token_plot(rows),
        reward_plot(rows),
    ]


def render(where: Where) -> str:
    """The whole report as one HTML document."""
    run_dir = locate(where)
    if not (run_dir / "rows").is_dir():
        raise InputError(f"{run_dir}: not a run directory (no rows/ inside)")
    rows = read_table(run_dir, _COLUMNS).to_pylist()
    data = status_data(run_dir, slowest=10)
    cfg = run_config(run_dir)
    harness = cfg.get("harness") or {}
    model = cfg.get("model") or {}
    state = data["state"] + (f": {data['stopped']}" if data["stopped"] else "")
    cards = [
        ("state", state),
        ("rows", data["rows"]),
        ("final", data["final"]),
        ("accepted", data["accept"]),
        ("masked", data["mask"]),
        ("mask rate", "-" if data["mask_rate"] is None else f"{data['mask_rate']:.1%}"),
        ("retried pairs", data["pairs_retried"]),
        ("mean reward", "-" if data["mean_reward"] is None else f"{data['mean_reward']:.3f}"),
    ]
    if data["pending"] is not None:
        cards.insert(3, ("pending", data["pending"]))
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>rollout report: {_esc(data['run_id'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>Run {_esc(data['run_id'])}</h1>",
        f"<p class=sub>harness {_esc(harness.get('name', '?'))} "
        f"{_esc(harness.get('version') or '(tested pin)')}"
        f" · model {_esc(model.get('name', '?'))} ({_esc(model.get('provider', '?'))})"
        f" · samples {_esc(cfg.get('samples', '?'))}"
        f" · generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}</p>",
        '<div class="cards">',
        *(f'<div class="card"><b>{_esc(v)}</b><span>{_esc(k)}</span></div>' for k, v in cards),
        "</div>",
    ]
    for plot in build_plots(rows):
        parts.append(f'<section id="{plot.key}"><h2>{_esc(plot.title)}</h2>')
        parts.append(f'<p class="caption">{_esc(plot.caption)}</p>{plot.svg}</section>')
    if data["failures"]:
        parts.append("<h2>Failure kinds (every attempt)</h2>")
        parts.append(
            _table(
                ["failure kind", "rows", "first error message"],
                [[f["failure_kind"], f["rows"], f["example"]] for f in data["failures"]],
                {1},
            )
        )
    parts.append("<h2>Slowest rollouts</h2>")
    parts.append(
        _table(
            ["rollout", "status", "failure kind", "decision", "seconds"],
            [
                [r["rollout_id"], r["status"], r["failure_kind"], r["decision"], f"{r['t_total_s']:.1f}"]
                for r in data["slowest"]
            ],
            {4},
        )
    )
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "".join(parts)


def write_report(run_dir: Where, out: Where | None = None) -> Path | Location:
    """The report, written whole to ``out`` (default: the run's own ``report.html``, wherever the run
    lives); returned as a local path when it is one."""
    text = render(run_dir)
    target = locate(out) if out is not None else locate(run_dir) / "report.html"
    target.write_text(text)
    return target.local or target
