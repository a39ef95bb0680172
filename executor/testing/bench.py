"""`rollout bench`: what the executor itself costs, measured side by side with doing without it.

(a) overhead per rollout: the real Codex harness through the executor's worker actor, one session at a
    time, versus the same rollout by hand against the same scripted model (a fresh workspace and config,
    `codex exec`, the verifier; `codex exec` alone is printed too), the two interleaved run by run;
(b) machinery throughput: a null harness (a command that exits at once) through the executor, versus a
    plain asyncio runner doing the same sessions (same sandboxes, same harness) without Ray, Arrow or policy;
(c) driver memory: peak RSS of a driver process for N and 10*N rollouts (null workers, so the driver's
    loop, Ray transport, Arrow store and policy are what is measured);
(d) the Arrow store: rows per second appended, and the time to resume-scan a large run;
(e) a run's fixed costs: the real `rollout run` command, cold, in a fresh process each time, on a small
    batch of one-tool Codex rollouts; when each phase (CLI imported, config read, Ray up, first worker
    ready, first row, last row, summary, exit) fell, in seconds after the command was spawned;
(g) (a) in containers: the executor's sandboxes are containers of one image (``--provider container``'s,
    else the tests' base image), against `codex exec` run by hand with `podman run --rm` in that image.
Figures are printed, never asserted: speed is measured here, not in tests.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The parts, each a module of its own; their names stay importable from here.
from executor.testing.bench_common import (  # noqa: F401
    NULL_COMMAND,
    PROMPT,
    SCRIPT,
    VERIFY,
    _direct_runs,
    _median_p90,
    _ModelThread,
    _run_driver,
    _write_config,
    _write_tasks,
)
from executor.testing.bench_fixed import (  # noqa: F401
    PHASES,
    WARM_CPU_NOTE,
    _medians,
    _one_run,
    _phase_line,
    _rollout,
    fixed_costs,
)
from executor.testing.bench_memory import _null_worker_class, driver_memory, driver_memory_child  # noqa: F401
from executor.testing.bench_overhead import _podman_by_hand, default_container, overhead  # noqa: F401
from executor.testing.bench_store import store
from executor.testing.bench_throughput import (  # noqa: F401
    _end_to_end_rate,
    _plain_runner,
    _steady_rate,
    throughput,
)

# ----------------------------------------------------------------------------------------------------


def run_all(
    parts: str,
    runs: int,
    null_rollouts: int,
    memory_rollouts: int,
    store_rows: int,
    echo: Callable[[str], None] = print,
    token_ids: int = 0,
    cold_runs: int = 5,
    cold_rollouts: int = 10,
    cold_concurrency: int = 1,
    container: Any = None,
    scale: tuple[int, int, float] = (1000, 8, 30.0),
    scale_fixed: bool = False,
    scale_nodes: int = 0,
    isolation: str | None = None,
    store_out: str | None = None,
) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="rollout-bench-", dir=str(Path.home())))
    # The machine's load average (1 min) as the run starts and ends: on a shared machine, what to read
    # the figures against.
    out: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    try:
        if "d" in parts:
            out["d"] = d = store(store_rows, scratch, store_out)
            echo(
                f"(d) store ({d['store']}): {d['append_rows_per_s']:,.0f} rows/s appended; "
                f"resume scan of {d['rows']:,} rows {d['resume_scan_s']:.2f} s"
            )
        if "a" in parts:
            out["a"] = a = overhead(runs, scratch, container, isolation)
            echo(
                f"(a) overhead, {runs} sequential Codex rollouts: "
                f"direct median {a['direct_median_s']:.3f} s (codex exec alone "
                f"{a['direct_codex_only_median_s']:.3f} s), "
                f"executor median {a['executor_session_median_s']:.3f} s (phases: setup "
                f"{a['executor_setup_phase_median_s']:.3f}, harness "
                f"{a['executor_harness_phase_median_s']:.3f}, verify "
                f"{a['executor_verify_phase_median_s']:.3f}, cleanup "
                f"{a['executor_cleanup_phase_median_s']:.3f} s), ratio {a['ratio']:.2f} "
                f"(median of the pairs' ratios {a['pairwise_ratio_median']:.2f})"
            )
        if "b" in parts:
            out["b"] = b = throughput(null_rollouts, (32, 128), scratch)
            for r in b:
                echo(
                    f"(b) null harness at concurrency {r['concurrency']}: "
                    f"executor {r['executor_steady_per_s']:.1f}/s, "
                    f"plain asyncio {r['plain_steady_per_s']:.1f}/s "
                    "(steady state: the 10th to the 90th percentile of ends), "
                    f"ratio {r['ratio']:.2f}; first to last end "
                    f"{r['executor_end_to_end_per_s']:.1f}/s vs {r['plain_end_to_end_per_s']:.1f}/s; "
                    f"with start-up {r['executor_per_s']:.1f}/s vs {r['plain_per_s']:.1f}/s"
                )
        if "c" in parts:
            out["c"] = c = driver_memory(memory_rollouts, scratch, token_ids)
            tokens = f", {token_ids:,} token ids per model call" if token_ids else ""
            echo(
                f"(c) driver peak RSS{tokens}: {c[0]['rollouts']:,} rollouts {c[0]['peak_rss_mb']:.0f} MB, "
                f"{c[1]['rollouts']:,} rollouts {c[1]['peak_rss_mb']:.0f} MB, "
                f"ratio {c[1]['peak_rss_mb'] / c[0]['peak_rss_mb']:.2f}"
            )
        if "e" in parts:
            (scratch / "e").mkdir()  # by-hand rollouts of its own: (a)'s are named alike
            out["e"] = e = fixed_costs(cold_rollouts, cold_runs, cold_concurrency, scratch / "e")
            echo(_phase_line(e))
        if "g" in parts:
            (scratch / "g").mkdir()
            out["g"] = g = overhead(runs, scratch / "g", container or default_container())
            echo(
                f"(g) overhead in containers ({g['image']}), {runs} sequential Codex rollouts: "
                f"by hand with `podman run --rm` {g['direct_median_s']:.3f} s, "
                f"executor median {g['executor_session_median_s']:.3f} s (phases: setup "
                f"{g['executor_setup_phase_median_s']:.3f}, harness "
                f"{g['executor_harness_phase_median_s']:.3f}, verify "
                f"{g['executor_verify_phase_median_s']:.3f}, cleanup "
                f"{g['executor_cleanup_phase_median_s']:.3f} s), ratio {g['ratio']:.2f} "
                f"(median of the pairs' ratios {g['pairwise_ratio_median']:.2f})"
            )
        if "f" in parts:
            from executor.testing import bench_scale

            (scratch / "f").mkdir()
            if scale_fixed:
                out["f"] = bench_scale.scale_and_fixed(*scale, scratch / "f", scale_nodes, echo)
            else:
                out["f"] = f = bench_scale.scale(*scale, scratch / "f", scale_nodes)
                echo(bench_scale.line(f))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["load"].append(os.getloadavg()[0])
    return out


# ----------------------------------------------------------------------------------------------------

PHASE_NAMES = {
    "cli": "CLI imported",
    "config": "config read",
    "preflight": "preflight done",
    "harness": "harness install checked",
    "ray_up": "Ray up",
    "workers_created": "worker actors created",
    "first_worker_ready": "first worker ready",
    "first_row": "first row",
    "last_row": "last row",
    "summary": "summary written",
    "exit": "process exited",
}


def _scale_rows(f: dict[str, Any] | None) -> list[str]:
    """Part (f)'s rows: the sessions' span against the ideal, and, with ``--scale-fixed``, what a
    session costs beyond the run's fixed costs (CPU by part, the workers' memory)."""
    if not f:
        return []
    nodes = f" on {f['nodes']} raylets" if f.get("nodes") else ""
    rows = [
        f"| (f) {f['sessions']:,} sessions of a null harness that sleeps {f['sleep_s']:g} s, all in flight "
        f"({f['workers']} workers{nodes}), first start to last end | {f['sessions_span_s']:.1f} s "
        f"| {f['ideal_s']:.0f} s ideal | {f['sessions_span_s'] / f['ideal_s']:.3f} |"
    ]
    if per := (f.get("beyond_fixed") or {}).get("per_session_ms"):
        from executor.testing.bench_scale import parts_text

        rows.append(
            f"| (f) CPU per session beyond the run's fixed costs, by part (the sandboxes' with the "
            f"commands they run: the null harness and the diff, ~9 ms) | {sum(per.values()):.1f} ms: "
            + parts_text(per, f["beyond_fixed"].get("kernel_per_session_ms") or {})
            + " | | |"
        )
        if (pages := f["beyond_fixed"].get("pages_per_session")) is not None:
            rows.append(
                f"| (f) pages the machine allocated per session beyond the fixed costs (4 KiB each) "
                f"| {pages:,.0f} | | |"
            )
        if (mb := f["beyond_fixed"].get("worker_mb_per_session")) is not None:
            rows.append(f"| (f) the workers' memory (PSS) per session in flight | {mb:.2f} MB | | |")
    return rows


def markdown(figures: dict[str, Any], command: str, when: str, machine: str) -> str:
    """The figures of one `rollout bench` as the tables of docs/performance.md."""
    load = figures.get("load")
    at = f" (load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end)" if load else ""
    lines = [f"Measured {when} on {machine}{at}: `{command}`.", ""]
    lines += ["| comparison | executor | without it | ratio |", "|---|---|---|---|"]
    if a := figures.get("a"):
        lines.append(
            f"| (a) one Codex rollout, sequential, median of {a['runs']} (whole session) "
            f"| {a['executor_session_median_s']:.3f} s | {a['direct_median_s']:.3f} s by hand "
            f"(`codex exec` alone {a['direct_codex_only_median_s']:.3f} s) "
            f"| {a['ratio']:.2f} (median of the pairs' ratios {a['pairwise_ratio_median']:.2f}) |"
        )
    if g := figures.get("g"):
        lines.append(
            f"| (g) the same in a container of `{g['image']}`, median of {g['runs']} "
            f"| {g['executor_session_median_s']:.3f} s | {g['direct_median_s']:.3f} s by hand "
            f"(`podman run --rm` of `codex exec`) "
            f"| {g['ratio']:.2f} (median of the pairs' ratios {g['pairwise_ratio_median']:.2f}) |"
        )
    if (e := figures.get("e")) and "exit" in e.get("warm_median_s", {}):
        warm = e["warm_median_s"]["exit"]
        lines.append(
            f"| (e) {e['rollouts']} one-tool Codex rollouts, the whole `rollout run` attached to a warm "
            f"executor, median of {e['runs']} | {warm:.2f} s | {e['by_hand_median_s']:.2f} s by hand "
            f"| {warm / e['by_hand_median_s']:.2f} |"
        )
    if e and "exit" in e.get("changed_median_s", {}):
        changed = e["changed_median_s"]["exit"]
        lines.append(
            f"| (e) the same, each run's config changed since the run before (the workers built for "
            f"another), median of {e['runs']} | {changed:.2f} s | {e['by_hand_median_s']:.2f} s by hand "
            f"| {changed / e['by_hand_median_s']:.2f} |"
        )
    for r in figures.get("b", []):
        lines.append(
            f"| (b) null harness, concurrency {r['concurrency']}, steady state "
            f"| {r['executor_steady_per_s']:.1f} rollouts/s "
            f"| {r['plain_steady_per_s']:.1f}/s (plain asyncio) "
            f"| {r['ratio']:.2f} |"
        )
    if c := figures.get("c"):
        small, large = c
        lines.append(
            f"| (c) driver peak RSS, {small['rollouts']:,} vs {large['rollouts']:,} null rollouts "
            f"| {small['peak_rss_mb']:.0f} MB vs {large['peak_rss_mb']:.0f} MB | "
            f"| {large['peak_rss_mb'] / small['peak_rss_mb']:.2f} |"
        )
    if d := figures.get("d"):
        lines.append(
            f"| (d) Arrow store | {d['append_rows_per_s']:,.0f} rows/s appended; resume scan of "
            f"{d['rows']:,} rows {d['resume_scan_s']:.2f} s | | |"
        )
    lines += _scale_rows(figures.get("f"))
    for name, part in (("a", a), ("g", g)):
        if part:
            lines += [
                "",
                f"({name}) by phase, medians: setup {part['executor_setup_phase_median_s'] * 1000:.0f} ms, "
                f"harness {part['executor_harness_phase_median_s'] * 1000:.0f} ms (`codex exec` by hand "
                f"{part['direct_codex_only_median_s'] * 1000:.0f} ms), verify "
                f"{part['executor_verify_phase_median_s'] * 1000:.0f} ms, cleanup "
                f"{part['executor_cleanup_phase_median_s'] * 1000:.0f} ms.",
            ]
    if e:
        lines += [
            "",
            f"(e) fixed costs: {e['runs']} `rollout run`s of {e['rollouts']} one-tool Codex rollouts at "
            f"concurrency {e['concurrency']}, each in a fresh process, cold and attached to a warm executor "
            f"(`rollout up`), interleaved; median seconds after the spawn. The same rollouts by hand "
            f"(fresh workspace and config, `codex exec`, the verifier, one after another): "
            f"{e['by_hand_median_s']:.2f} s.",
            "",
            "| phase | cold | warm | warm, config changed |",
            "|---|---|---|---|",
        ]
        cold, warm, changed = e["median_s"], e.get("warm_median_s", {}), e.get("changed_median_s", {})

        def cell(medians: dict[str, float], name: str) -> str:
            return f"{medians[name]:.2f}" if name in medians else ""

        order = sorted((n for n in PHASES if n in cold), key=cold.__getitem__)
        lines += [
            f"| {PHASE_NAMES.get(n, n)} | {cold[n]:.2f} | {cell(warm, n)} | {cell(changed, n)} |"
            for n in order
        ]
        if "cpu_s" in cold and "cpu_s" in warm:
            lines.append(
                f"| the command's CPU (s) | {cold['cpu_s']:.2f} | {warm['cpu_s']:.2f}{WARM_CPU_NOTE} "
                f"| {cell(changed, 'cpu_s')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "memory-child":
        print(json.dumps(driver_memory_child(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))))
