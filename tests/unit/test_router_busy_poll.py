"""router.busy_poll: the event loop spins (yields with nothing to wait for) for the window after a touch, then
sleeps until the next one; a window of 0 never spins."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router import busy_poll
from pdserve.router.busy_poll import BusyPoll


@pytest.fixture
def spins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the zero-second yields BusyPoll.run makes."""
    count = [0]
    real_sleep = asyncio.sleep

    async def counting_sleep(delay: float) -> None:
        assert delay == 0
        count[0] += 1
        await real_sleep(0)

    monkeypatch.setattr(busy_poll.asyncio, "sleep", counting_sleep)
    return count


async def _spins_during(poll: BusyPoll, spins: list[int], touch: bool, wait_s: float) -> int:
    task = asyncio.create_task(poll.run())
    try:
        await asyncio.sleep(0)  # NOTE: run() starts and waits; this yield is counted before `before`
        before = spins[0]
        if touch:
            poll.touch()
        await _block(wait_s)
        return spins[0] - before
    finally:
        task.cancel()


async def _block(seconds: float) -> None:
    """Wait on a timer (a blocking select in the loop unless something spins)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_later(seconds, done.set_result, None)
    await done


def test_spins_for_the_window_after_a_touch_then_stops(spins: list[int]) -> None:
    async def main() -> tuple[int, int]:
        poll = BusyPoll(0.05)
        during = await _spins_during(poll, spins, touch=True, wait_s=0.1)
        after = await _spins_during(poll, spins, touch=False, wait_s=0.05)
        return during, after

    during, after = asyncio.run(main())
    assert during > 50  # NOTE: each turn of the loop is microseconds; 50 ms of them
    assert after == 0


def test_a_zero_window_never_spins(spins: list[int]) -> None:
    async def main() -> int:
        return await _spins_during(BusyPoll(0.0), spins, touch=True, wait_s=0.05)

    assert asyncio.run(main()) == 0


def test_many_requests_in_flight_stop_the_spinning(spins: list[int]) -> None:
    """Past MAX_IN_FLIGHT the loop is busy anyway, and spinning would keep the GIL from gRPC's poller thread."""
    in_flight = [busy_poll.MAX_IN_FLIGHT + 1]

    async def main() -> tuple[int, int]:
        poll = BusyPoll(0.05, lambda: in_flight[0])
        busy = await _spins_during(poll, spins, touch=True, wait_s=0.05)
        in_flight[0] = 1
        light = await _spins_during(poll, spins, touch=True, wait_s=0.05)
        return busy, light

    busy, light = asyncio.run(main())
    assert busy == 0 and light > 50
