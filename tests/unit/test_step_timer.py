"""core.step_timer: step intervals bucketed cumulatively; quantiles of a window from two snapshots."""

from __future__ import annotations

import math

from pdserve.core.step_timer import StepTimer, quantile_ms


def test_intervals_between_busy_steps_are_counted_and_idle_gaps_are_not() -> None:
    timer = StepTimer()
    timer.mark(True, now=0.0)
    timer.mark(True, now=0.0018)  # 1.8 ms -> the 2 ms bucket
    before = timer.counters()
    for i in range(1, 100):
        timer.mark(True, now=0.0018 + i * 0.0009)  # 0.9 ms steps
    timer.mark(False, now=0.0018 + 99 * 0.0009 + 0.040)  # a 40 ms step, then idle
    timer.mark(True, now=10.0)  # after idling: not an interval
    timer.mark(True, now=10.0 + 0.3)  # 300 ms
    after = timer.counters()
    assert sum(before.values()) == 1 and before["step_ms_le_2"] == 1
    assert sum(after.values()) - sum(before.values()) == 101
    assert quantile_ms(before, after, 0.5) == 1 and quantile_ms(before, after, 0.99) == 50
    assert quantile_ms(before, after, 1.0) == 500
    assert quantile_ms(after, after, 0.5) is None


def test_a_step_slower_than_every_bound_lands_in_the_inf_bucket() -> None:
    timer = StepTimer()
    timer.mark(True, now=0.0)
    timer.mark(True, now=5.0)
    assert timer.counters()["step_ms_le_inf"] == 1 and math.isinf(quantile_ms({}, timer.counters(), 0.5) or 0)
