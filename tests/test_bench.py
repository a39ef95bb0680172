"""The benchmark's arithmetic (which rollouts its steady-state rate counts), its phases and its page."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.testing.bench import _end_to_end_rate, _steady_rate
from tests.conftest import ended


def test_the_steady_rate_leaves_out_the_first_ramp_and_the_drain():
    ramp = [i * 1.0 for i in range(10)]  # one a second while workers come up
    busy = [10 + i * 0.1 for i in range(80)]  # ten a second with every slot busy
    drain = [18 + i * 0.5 for i in range(10)]  # the last wave, slots falling idle
    ends = drain + busy + ramp  # in no order, as rows arrive
    assert abs(_steady_rate(ends) - 10.0) < 0.2
    assert _end_to_end_rate(ends) < 5.0


def test_too_few_ends_have_no_rate():
    assert _steady_rate([]) == 0.0 and _steady_rate([1.0]) == 0.0 and _steady_rate([2.0, 2.0]) == 0.0
    assert _end_to_end_rate([3.0]) == 0.0


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_the_fixed_costs_part_times_every_phase_of_a_real_cold_run(tmp_path):
    from executor.testing.bench import PHASES, _phase_line, fixed_costs

    e = fixed_costs(rollouts=2, runs=1, concurrency=1, scratch=tmp_path)
    (run,) = e["all"]
    assert set(PHASES) <= set(run), set(PHASES) - set(run)
    order = (
        "cli",
        "config",
        "ray_up",
        "preflight",
        "workers_created",
        "first_row",
        "last_row",
        "summary",
        "exit",
    )
    assert [run[n] for n in order] == sorted(run[n] for n in order)
    assert run["left_sandbox_processes"] == 0
    # The same run attached to the warm executor `rollout up` started, and the same rollouts by hand.
    (warm,) = e["all_warm"]
    assert [warm[n] for n in order] == sorted(warm[n] for n in order)
    assert warm["left_sandbox_processes"] == 0
    assert e["by_hand_median_s"] > 0
    assert "first_row" in _phase_line(e)


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )


def test_markdown_writes_the_measured_tables_into_the_pages_bench_part_and_nothing_else(tmp_path):
    page = tmp_path / "performance.md"
    before = "# Performance\n\nWhy we measure.\n\n<!-- generated: bench -->\nold figures\n"
    after = "<!-- end generated: bench -->\n\nWhere the time went.\n"
    page.write_text(before + after)
    done = _bench("--parts", "d", "--store-rows", "2000", "--markdown", str(page), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    text = page.read_text()
    assert text.startswith(before.replace("old figures\n", "")) and text.endswith(after)
    assert "old figures" not in text
    assert "| (d) Arrow store |" in text and "rollout bench --parts d --store-rows 2000" in text


def test_markdown_into_a_page_without_a_bench_part_fails_before_measuring(tmp_path):
    page = tmp_path / "notes.md"
    page.write_text("# Notes\n")
    done = _bench("--parts", "a", "--markdown", str(page), cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--markdown" in lines[0] and "notes.md" in lines[0] and "'bench'" in lines[0]
    assert page.read_text() == "# Notes\n"


def test_the_scale_parts_cpu_account_counts_the_children_it_never_reaps():
    """A grandchild orphaned before it works (so neither we nor its parent reap it) is still counted."""
    from executor.testing.bench_scale import TreeCpu

    work = "import os, time\nif (pid := os.fork()) == 0:\n    t = time.process_time() + 0.2\n"
    work += "    while time.process_time() < t: pass\nelse:\n    print(pid)\n"
    with TreeCpu() as ours:
        if ours.group is None:
            pytest.skip("no cpuacct cgroup of our own here (not root, or no cgroup v1)")
        orphan = int(subprocess.run([sys.executable, "-c", work], capture_output=True, check=True).stdout)
        # Waited for by its pidfd, readable once it has left the group: a pipe of its would close
        # before that (its files go first), and the group cannot be removed while it is in it.
        assert ended(orphan, bound_s=60)  # bounded as a safety net only
    assert ours.seconds is not None and ours.seconds >= 0.2
    assert not ours.group.exists()


def test_the_scale_parts_cpu_account_says_what_of_each_part_was_the_kernels():
    """A part whose process works in system calls is told apart from one whose process computes."""
    from executor.testing.bench_scale import TreeCpu

    # 0.4 s of CPU each: reads of /dev/zero (the kernel clears the buffer), or arithmetic.
    spin = "import os, sys, time\nt = time.process_time() + 0.4\nfd = os.open('/dev/zero', os.O_RDONLY)\n"
    spin += "while time.process_time() < t:\n"
    spin += "    os.read(fd, 1 << 20) if sys.argv[1] == 'k' else sum(range(9999))\n"
    with TreeCpu() as ours:
        if ours.group is None:
            pytest.skip("no cpuacct cgroup of our own here (not root, or no cgroup v1)")
        for part, mode in (("sandboxes", "k"), ("workers", "u")):
            child = subprocess.Popen([sys.executable, "-c", spin, mode])
            assert ours.move(child.pid, part)
            assert child.wait(timeout=60) == 0
    assert set(ours.kernel_parts) == {"sandboxes", "workers"}
    assert ours.kernel_parts["sandboxes"] > 0.5 * ours.parts["sandboxes"]
    assert ours.kernel_parts["workers"] < 0.5 * ours.parts["workers"]


def test_a_cpu_groups_kernel_share_is_read_from_its_ticks():
    from executor.testing.bench_scale import kernel_share

    assert kernel_share("user 30\nsystem 10\n") == 0.25
    assert kernel_share("user 0\nsystem 0\n") is None  # no tick yet: unknown, not 0
    assert kernel_share("") is None


def test_the_scale_part_reports_the_span_the_cpu_and_the_memory_a_session_costs_beyond_the_fixed():
    from executor.testing.bench import markdown
    from executor.testing.bench_scale import beyond_fixed

    small = {
        "rows": 8,
        "sessions": 8,
        "parts_cpu_ms_per_rollout": {"workers": 500.0},
        "parts_kernel_ms_per_rollout": {"workers": 100.0},
        "peak_workers_pss_mb": 800,
        "pages_per_rollout": 50_000.0,
    }
    big = {"rows": 1000, "sessions": 1000, "parts_cpu_ms_per_rollout": {"workers": 30.0}}
    big["pages_per_rollout"] = 2_400.0
    big["parts_kernel_ms_per_rollout"] = {"workers": 10.0}
    big["peak_workers_pss_mb"] = 800 + 992 * 0.25
    figures = beyond_fixed(small, big)
    # (30 ms x 1,000 - 500 ms x 8) / 992 sessions; 0.25 MB a session in flight.
    assert round(figures["per_session_ms"]["workers"], 2) == round((30_000 - 4_000) / 992, 2)
    assert figures["worker_mb_per_session"] == 0.25
    assert figures["pages_per_session"] == (2_400 * 1000 - 50_000 * 8) / 992
    run = {**big, "workers": 8, "nodes": 4, "sleep_s": 300, "sessions_span_s": 341.7, "ideal_s": 300}
    text = markdown({"f": {**run, "beyond_fixed": figures}}, "rollout bench --parts f", "today", "here")
    assert "| 341.7 s | 300 s ideal | 1.139 |" in text
    assert "| (f) the workers' memory (PSS) per session in flight | 0.25 MB |" in text
    assert "per session beyond the fixed costs (4 KiB each) | 2,016 |" in text
    # (10 ms x 1,000 - 100 ms x 8) / 992 of it in the kernel.
    assert "26.2 ms: workers 26.2 (in the kernel 9.3)" in text


def test_the_scale_parts_sampler_reads_the_sandboxes_memory_once_their_count_stops_rising():
    """The PSS of thousands of sandbox processes is the sampler's dearest read: never during their burst
    of starts (its cores are the run's), at the new peak once they are all up, and every few samples."""
    from executor.testing.bench_scale import PSS_EVERY, pss_due

    assert not pss_due(count=900, seen=400, read_at=0, samples=PSS_EVERY)  # still rising
    assert pss_due(count=1000, seen=1000, read_at=400, samples=1)  # up: a new peak
    assert not pss_due(count=1000, seen=1000, read_at=1000, samples=1)  # read at this count already
    assert pss_due(count=990, seen=1000, read_at=1000, samples=2 * PSS_EVERY)  # every few samples
