"""``colossal_lite.testing``: the legacy test helpers, each run for real (processes, ports, signals)."""
import inspect
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import colossal_lite
from colossal_lite.testing import (
    assert_close,
    assert_close_loose,
    assert_equal,
    assert_not_equal,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    spawn,
)
from colossal_lite.utils import free_port


# -- parameterize ----------------------------------------------------------------------------------
def test_parameterize_runs_every_value_and_stacks_outer_slowest():
    seen = []

    @parameterize("person", ["xavier", "davis"])
    @parameterize("msg", ["hello", "bye"])
    def say(person, msg, end):
        seen.append(f"{person}: {msg}{end}")

    say(end="!")
    assert seen == ["xavier: hello!", "xavier: bye!", "davis: hello!", "davis: bye!"]
    assert say.__name__ == "say"
    assert list(inspect.signature(say).parameters) == ["end"]  # pytest asks only for the rest as fixtures


@parameterize("n", [1, 2])
def test_parameterize_on_a_test_function_leaves_fixtures_to_pytest(n, tmp_path):
    (tmp_path / f"n{n}").write_text("x")  # tmp_path came from pytest; n from parameterize
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"n{i}" for i in range(1, n + 1)]


def test_parameterize_names_the_failing_value_and_refuses_it_at_the_call():
    @parameterize("x", [1, 2, 3])
    def check(x):
        assert x < 2, "too big"

    with pytest.raises(AssertionError) as e:
        check()
    if hasattr(e.value, "__notes__"):
        assert "x=2" in " ".join(e.value.__notes__)
    with pytest.raises(TypeError, match="given by @parameterize"):
        check(x=1)
    with pytest.raises(TypeError, match="no parameter 'y'"):
        parameterize("y", [1])(lambda x: x)


# -- rerun_on_exception ----------------------------------------------------------------------------
def test_rerun_on_exception_retries_until_success():
    calls = []

    @rerun_on_exception(exception_type=RuntimeError, pattern="^Address.*$", max_try=3)
    def flaky(value):
        calls.append(value)
        if len(calls) < 3:
            raise RuntimeError("Address already in use")
        return value * 2

    assert flaky(21) == 42 and calls == [21, 21, 21]


def test_rerun_on_exception_raises_the_last_error_when_tries_run_out():
    calls = []

    @rerun_on_exception(exception_type=RuntimeError, max_try=2)
    def always():
        calls.append(1)
        raise RuntimeError(f"failure {len(calls)}")

    with pytest.raises(RuntimeError, match="failure 2"):  # legacy returned None here, passing the test
        always()
    assert len(calls) == 2


def test_rerun_on_exception_lets_other_errors_through_at_once():
    calls = []

    @rerun_on_exception(exception_type=RuntimeError, pattern="in use")
    def wrong():
        calls.append(1)
        raise RuntimeError("shape mismatch")

    @rerun_on_exception(exception_type=RuntimeError)
    def other_type():
        calls.append(2)
        raise ValueError("not retried")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        wrong()
    with pytest.raises(ValueError):
        other_type()
    assert calls == [1, 2]


def test_rerun_if_address_is_in_use_reruns_a_port_clash_only():
    calls = []

    @rerun_if_address_is_in_use()
    def clash():
        calls.append(1)
        if len(calls) == 1:  # the words torch's TCPStore uses
            raise RuntimeError("The server socket has failed to listen on any local network address. "
                               "port: 1, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use")

    clash()
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match="other"):
        rerun_if_address_is_in_use()(lambda: (_ for _ in ()).throw(RuntimeError("other")))()


# -- comparisons -----------------------------------------------------------------------------------
def test_comparisons():
    a = torch.tensor([1.0, 2.0])
    assert_equal(a, a.clone())
    assert_not_equal(a, a + 1)
    assert_close(a, a + 1e-9)
    assert_close_loose(a, a + 5e-4)
    with pytest.raises(AssertionError, match="largest absolute difference 0.01"):
        assert_close(a, a + 0.01)
    with pytest.raises(AssertionError):
        assert_close_loose(a, a + 0.01)
    with pytest.raises(AssertionError, match="same shape"):
        assert_equal(a, torch.ones(3))
    with pytest.raises(AssertionError):
        assert_not_equal(a, a.clone())


def test_utils_module_and_free_port():
    from colossal_lite.testing import utils

    for name in ("parameterize", "rerun_on_exception", "rerun_if_address_is_in_use", "spawn", "assert_close",
                 "assert_close_loose", "assert_equal", "assert_not_equal"):
        assert getattr(utils, name) is getattr(colossal_lite.testing, name)
    port = free_port()
    import socket

    with socket.socket() as s:  # free right now: it can be bound
        s.bind(("127.0.0.1", port))


# -- spawn -----------------------------------------------------------------------------------------
def _record_env(rank, world_size, port, out_dir):
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    colossal_lite.launch_from_torch(config={}, backend="gloo", verbose=False)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    values = [os.environ[k] for k in keys] + [str(world_size), str(port), str(int(total.item()))]
    Path(out_dir, f"rank{rank}").write_text(" ".join(values))


def _fail_on_rank_1(rank, world_size, port):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(60)  # rank 0 would wait long; spawn must stop it when rank 1 fails


def _hang(rank, world_size, port):
    time.sleep(600)


def test_spawn_sets_the_distributed_environment(tmp_path):
    spawn(_record_env, nprocs=2, out_dir=str(tmp_path))
    lines = [Path(tmp_path, f"rank{r}").read_text().split() for r in range(2)]
    port = lines[0][4]
    assert lines == [[str(r), str(r), "2", "127.0.0.1", port, "2", port, "3"] for r in range(2)]


def test_a_failing_rank_fails_spawn_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as e:
        spawn(_fail_on_rank_1, nprocs=2)
    assert "ValueError: rank 1 gives up" in str(e.value) and "_fail_on_rank_1" in str(e.value)
    assert time.monotonic() - start < 50  # rank 0 was stopped, not waited for


def test_spawn_times_out_with_the_ranks_stacks(capfd):
    # the limit leaves the spawned rank time to import torch and the test module even on a loaded machine (with
    # 8 s, under two pytest workers, the stack once showed the rank still starting up, not yet in _hang)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] still running after 16 s"):
        spawn(_hang, nprocs=1, timeout_s=16)
    assert "_hang" in capfd.readouterr().err  # the stuck rank's Python stack
