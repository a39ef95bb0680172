"""The benchmark's arithmetic: which rollouts its steady-state rate counts."""

import pytest

from executor.testing.bench import _end_to_end_rate, _steady_rate


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
        "preflight",
        "ray_up",
        "workers_created",
        "first_row",
        "last_row",
        "summary",
        "exit",
    )
    assert [run[n] for n in order] == sorted(run[n] for n in order)
    assert run["left_sandbox_processes"] == 0
    assert "first_row" in _phase_line(e)
