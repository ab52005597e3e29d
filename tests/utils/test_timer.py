import time

import pytest
import torch

from colossal_lite.utils.timer import MultiTimer, Timer


def test_timer_measures_sleep():
    timer = Timer()
    timer.start()
    time.sleep(0.05)
    elapsed = timer.stop()
    assert 0.04 <= elapsed < 1.0
    assert timer.get_elapsed_time() == elapsed
    assert not timer.has_history


def test_timer_history_and_reset():
    timer = Timer()
    durations = []
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        durations.append(timer.stop(keep_in_history=True))
    assert timer.has_history
    assert timer.get_history_sum() == pytest.approx(sum(durations))
    assert timer.get_history_mean() == pytest.approx(sum(durations) / 2)
    assert timer.get_history_mean() >= 0.015
    timer.reset()
    assert not timer.has_history
    assert timer.get_history_sum() == 0.0
    assert timer.get_history_mean() == 0.0
    assert timer.get_elapsed_time() == 0.0


def test_timer_lap_keeps_running():
    timer = Timer()
    timer.start()
    time.sleep(0.02)
    first = timer.lap()
    time.sleep(0.02)
    second = timer.lap()
    assert 0.015 <= first < second < 1.0
    assert timer.is_running
    total = timer.stop()
    assert total >= second
    assert not timer.is_running


def test_timer_stop_without_start_raises():
    with pytest.raises(RuntimeError, match="before Timer.start"):
        Timer().stop()


def test_current_time_is_perf_counter():
    before = time.perf_counter()
    now = Timer().current_time
    assert before <= now <= time.perf_counter()


def test_timer_does_not_sync_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    timer = Timer(sync_cuda=True)
    timer.start()
    timer.stop()
    assert calls == []


def test_timer_sync_policy(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    Timer().start()  # None: CUDA not initialised -> no sync
    Timer(sync_cuda=False).start()
    assert calls == []
    Timer(sync_cuda=True).start()
    assert len(calls) == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    Timer().start()
    assert len(calls) == 2


def test_multitimer_start_stop_and_iter():
    timers = MultiTimer()
    timers.start("fwd")
    timers.start("bwd")
    time.sleep(0.01)
    fwd = timers.stop("fwd", keep_in_history=True)
    bwd = timers.stop("bwd", keep_in_history=False)
    assert 0.005 <= fwd < 1.0 and 0.005 <= bwd < 1.0
    assert timers.get_timer("fwd").has_history
    assert not timers.get_timer("bwd").has_history
    names = [name for name, timer in timers]
    assert names == ["fwd", "bwd"]
    assert all(isinstance(timer, Timer) for _, timer in timers)


def test_multitimer_reset_all_and_one():
    timers = MultiTimer()
    for name in ("a", "b"):
        timers.start(name)
        timers.stop(name, keep_in_history=True)
    timers.reset("a")
    assert not timers.get_timer("a").has_history
    assert timers.get_timer("b").has_history
    timers.start("a")
    timers.stop("a", keep_in_history=True)
    timers.reset()
    assert not any(timer.has_history for _, timer in timers)
    assert all(timer.get_elapsed_time() == 0.0 for _, timer in timers)


def test_multitimer_off_is_noop():
    timers = MultiTimer(on=False)
    assert not timers.is_on()
    timers.start("x")
    assert timers.stop("x", keep_in_history=True) is None
    assert list(timers) == []
    timers.set_status(True)
    assert timers.is_on()
    timers.start("x")
    assert timers.stop("x", keep_in_history=True) >= 0.0
    assert timers.get_timer("x").has_history


def test_multitimer_unknown_name():
    timers = MultiTimer()
    with pytest.raises(KeyError, match="nope"):
        timers.get_timer("nope")
    with pytest.raises(KeyError, match="never started"):
        timers.stop("nope", keep_in_history=False)
