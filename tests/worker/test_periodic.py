"""The loop the pacer, the reaper and the heartbeat share (``worker.common.periodic``): a tick that
raises is logged and the loop goes on, the first tick comes at once or after an interval, and
``stop`` ends the thread without waiting out an interval."""

from __future__ import annotations

import logging
import threading
import time

from worker.common.periodic import PeriodicThread


def test_a_tick_that_raises_is_logged_and_the_loop_goes_on(caplog):
    ticks: list[float] = []
    third = threading.Event()

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) >= 3:
            third.set()
        raise ConnectionError("the database is away")

    with caplog.at_level(logging.WARNING, logger="worker.common.periodic"):
        loop = PeriodicThread("test-periodic", 0.01, tick).start()
        try:
            assert third.wait(10), "the loop died on the first error"
        finally:
            loop.stop()
    assert not loop._thread.is_alive()
    failed = [r for r in caplog.records if r.getMessage() == "test-periodic: tick failed"]
    assert failed and failed[0].exc_info[0] is ConnectionError


def test_first_tick_now_or_after_an_interval_and_stop_does_not_wait_out_the_interval():
    now = threading.Event()
    at_once = PeriodicThread("test-now", 3600, now.set).start()
    assert now.wait(10)
    later = threading.Event()
    waits = PeriodicThread("test-later", 3600, later.set, first_now=False).start()
    started = time.monotonic()
    at_once.stop()
    waits.stop()
    assert time.monotonic() - started < 5 and not later.is_set()
    assert not at_once._thread.is_alive() and not waits._thread.is_alive()


def test_stop_from_inside_a_tick_does_not_join_itself():
    stopped = threading.Event()
    loop: PeriodicThread

    def tick() -> None:
        loop.stop()  # e.g. a heartbeat stopped by the thread it runs on
        stopped.set()

    loop = PeriodicThread("test-self-stop", 0.01, tick)
    loop.start()
    assert stopped.wait(10)
    loop._thread.join(10)
    assert not loop._thread.is_alive()
