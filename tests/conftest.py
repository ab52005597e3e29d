"""Test tiers: every test that starts a process is marked ``slow`` at collection, by reading its code.

The rule reads the bytecode of each test function, of the fixtures it uses (defined under tests/), and,
transitively, of the helpers under tests/ they call, and marks the test ``slow`` when it reaches anything in
``_starters()`` (``run_torchrun``, ``subprocess.run``, ``colossal_lite.testing.spawn``, ``mp.spawn``,
``os.fork``, ...). ``python -m pytest -m "not slow" tests`` is then the fast tier.

So that the rule cannot silently go wrong, a guard makes any test that is not marked ``slow`` and still starts
a process (``subprocess.Popen``, a ``multiprocessing`` process, ``os.fork``, ...) fail, in every run, with a
message saying to mark it or to teach the rule its helper. A test that is slow without starting processes is
marked by hand, ``@pytest.mark.slow``; a fast-tier run lists the unmarked tests that took longer than
``SLOW_TEST_S``.
"""
from __future__ import annotations

import collections
import dis
import functools
import gc
import multiprocessing.process
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)  # tests/test_tiers.py runs this file's rule and guard on sample tests

TESTS = Path(__file__).resolve().parent
SLOW = "slow"
SLOW_TEST_S = 2.0  # an unmarked test slower than this is listed at the end of a fast-tier run


# --------------------------------------------------------------------------- the rule, at collection

@functools.lru_cache(maxsize=None)
def _starters() -> frozenset:
    """The callables that start a process, by identity (``from subprocess import run`` and ``subprocess.run``
    are the same object)."""
    import asyncio
    import multiprocessing
    import pty

    import torch.multiprocessing as tmp

    import colossal_lite.testing

    found = [subprocess.run, subprocess.Popen, subprocess.call, subprocess.check_call, subprocess.check_output,
             subprocess.getoutput, subprocess.getstatusoutput, multiprocessing.Process, multiprocessing.Pool,
             multiprocessing.get_context, tmp.spawn, tmp.start_processes, tmp.Process, tmp.get_context,
             pty.fork, pty.spawn, asyncio.create_subprocess_exec, asyncio.create_subprocess_shell,
             colossal_lite.testing.spawn]
    for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
                 "spawnl", "spawnle", "spawnvp", "spawnlp", "execv", "execve", "execvp", "execl"):
        if hasattr(os, name):
            found.append(getattr(os, name))
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def _file_in_tests(filename: str) -> bool:
    return bool(filename) and Path(filename).resolve().is_relative_to(TESTS)


def _defined_in_tests(obj) -> bool:
    if isinstance(obj, types.FunctionType):
        return _file_in_tests(obj.__code__.co_filename)
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return _file_in_tests(getattr(module, "__file__", None) or "")


def _reaches(obj, seen: set) -> bool:
    """True when ``obj`` is a process starter, or is code under tests/ that reaches one."""
    try:
        if obj in _starters():
            return True
    except TypeError:  # unhashable
        return False
    if isinstance(obj, functools.partial):
        return _reaches(obj.func, seen) or any(_reaches(a, seen) for a in obj.args)
    if isinstance(obj, (types.MethodType, staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType) and not _defined_in_tests(obj):
        # a decorator's wrapper (``rerun_if_address_is_in_use``, ``parameterize``): read what it wraps
        inner = [getattr(obj, "__wrapped__", None)] + [c.cell_contents for c in obj.__closure__ or () if _cell_filled(c)]
        return any(_reaches(f, seen) for f in inner if callable(f) and f is not obj)
    if isinstance(obj, type) and _defined_in_tests(obj) and id(obj) not in seen:
        seen.add(id(obj))
        return any(_reaches(v, seen) for v in vars(obj).values() if callable(v) or isinstance(v, (staticmethod, classmethod)))
    if isinstance(obj, types.FunctionType) and _defined_in_tests(obj):
        if not obj.__closure__:  # the answer depends on the code and its module only: ask once per session
            if obj.__code__ not in _answers:
                _answers[obj.__code__] = False  # a helper that calls itself is not read again meanwhile
                _answers[obj.__code__] = _code_reaches(obj.__code__, obj.__globals__, {}, seen)
            return _answers[obj.__code__]
        if id(obj.__code__) in seen:
            return False
        seen.add(id(obj.__code__))
        closure = {n: c.cell_contents for n, c in zip(obj.__code__.co_freevars, obj.__closure__) if _cell_filled(c)}
        return _code_reaches(obj.__code__, obj.__globals__, closure, seen)
    return False


_answers: dict = {}


def _cell_filled(cell) -> bool:
    try:
        return cell.cell_contents is not cell  # reading an empty cell raises
    except ValueError:
        return False


def _code_reaches(code: types.CodeType, globs: dict, closure: dict, seen: set) -> bool:
    """Follow every ``name.attr.attr`` chain the code loads (globals, closure cells, local imports) and ask
    ``_reaches`` of each object on it; nested functions and lambdas are read too."""
    local_imports: dict = {}
    pending_import = None
    current = None
    for ins in dis.get_instructions(code):
        op, name = ins.opname, ins.argval
        if op == "KW_NAMES":  # the keyword names of a call (3.11's dis leaves its argval unresolved)
            name = code.co_consts[ins.arg]
        if isinstance(name, tuple) and "num_workers" in name:  # a DataLoader with worker processes
            return True
        if op == "IMPORT_NAME":
            pending_import = sys.modules.get(name)
            current = None
            continue
        if op == "IMPORT_FROM" and pending_import is not None:
            current = getattr(pending_import, name, None)
            if current is not None and _reaches(current, seen):
                return True
            continue
        if op in ("STORE_FAST", "STORE_NAME", "STORE_DEREF"):
            if current is not None:
                local_imports[name] = current
            elif pending_import is not None:  # ``import a.b`` binds ``a``
                local_imports[name] = sys.modules.get(pending_import.__name__.split(".")[0], pending_import)
            current = None
            continue
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            current = local_imports.get(name, globs.get(name, getattr(globs.get("__builtins__"), name, None)))
        elif op in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE"):
            current = local_imports.get(name, closure.get(name))
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and current is not None:
            current = getattr(current, name, None)
        else:
            if op != "POP_TOP":
                pending_import = None
            current = None
            if op == "LOAD_CONST" and isinstance(name, types.CodeType) and id(name) not in seen:
                seen.add(id(name))
                if _code_reaches(name, globs, closure, seen):
                    return True
            continue
        if current is not None and not isinstance(current, types.ModuleType) and _reaches(current, seen):
            return True
    return False


def _starts_processes(item) -> bool:
    seen: set = set()
    objs = [getattr(item, "obj", None)]
    objs += [fd.func for defs in item._fixtureinfo.name2fixturedefs.values() for fd in defs]
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        objs += [v for v in callspec.params.values() if callable(v)]
    return any(_reaches(o, seen) for o in objs if o is not None)


def pytest_configure(config):
    _install_guard()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker(SLOW) is None and (item.get_closest_marker("dist") is not None
                                                      or _starts_processes(item)):
            item.add_marker(SLOW)
    _heavy_files_first(items)


def _heavy_files_first(items) -> None:
    """Run the files with the most process-starting tests first, each file's tests together and in their order.
    Two workers (``-n 2 --dist loadfile``) take files in this order, so the suite ends on quick files instead of
    one worker finishing a long one alone."""
    slow_in = collections.Counter(item.path for item in items if item.get_closest_marker(SLOW) is not None)
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (-slow_in[item.path], first_seen[item.path]))


# --------------------------------------------------------------------------- the guard, at run time

_running = {"item": None}


def _check_may_start(what: str) -> None:
    item = _running["item"]
    if item is None or item.get_closest_marker(SLOW) is not None:
        return
    message = (f"{item.nodeid} started a process ({what}) but is not marked slow: the rule in tests/conftest.py "
               "did not see it. Teach the rule the helper it uses (_starters), or mark the test "
               "@pytest.mark.slow, so that the fast tier (-m 'not slow') stays free of processes.")
    item.stash[_violation] = message
    raise RuntimeError(message)


_violation = pytest.StashKey[str]()


def _guarded(func, describe):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        _check_may_start(describe(*args, **kwargs))
        return func(*args, **kwargs)
    wrapper._tiers_guard = True
    return wrapper


def _install_guard() -> None:
    if getattr(subprocess.Popen.__init__, "_tiers_guard", False):
        return
    subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__,
                                         lambda self, args, *a, **k: f"subprocess.Popen({args!r:.200})")
    multiprocessing.process.BaseProcess.start = _guarded(multiprocessing.process.BaseProcess.start,
                                                         lambda self: f"multiprocessing process {self.name}")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _guarded(getattr(os, name), lambda *a, _n=name, **k: f"os.{_n}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    before = _cpu_seconds() if os.environ.get(CPU_LOG) else None
    try:
        yield
    finally:
        _running["item"] = None
        _log_cpu(item, before)


# --------------------------------------------------------------------------- CPU seconds per test, on request

CPU_LOG = "COLOSSAL_LITE_TEST_CPU_LOG"  # a folder: each pytest process appends its tests' CPU seconds there


def _cpu_seconds():
    """User + system CPU seconds of this process and of its finished children (theirs include their own
    children's), which the machine's load does not change the way it changes wall time."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    helpers = sys.modules.get("dist_helpers")  # the launches its rank server ran are the server's children
    served = helpers.CHILD_CPU_S[0] if helpers is not None else 0.0
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + served


def _log_cpu(item, before) -> None:
    folder = os.environ.get(CPU_LOG)
    if before is None or not folder:
        return
    after = _cpu_seconds()
    with open(Path(folder) / f"cpu-{os.getpid()}.tsv", "a", encoding="utf-8") as f:
        f.write(f"{item.nodeid}\t{after[0] - before[0]:.3f}\t{after[1] - before[1]:.3f}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    message = item.stash.get(_violation, None)
    if message is not None:
        del item.stash[_violation]
    if message is not None and not report.failed:
        report.outcome = "failed"
        report.longrepr = message
    if report.when == "call" and item.get_closest_marker(SLOW) is None and report.duration > SLOW_TEST_S:
        item.config.stash.setdefault(_long_unmarked, []).append((report.duration, item.nodeid))


_long_unmarked = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    long = sorted(config.stash.get(_long_unmarked, []), reverse=True)
    if long:
        terminalreporter.section("tests slower than %.0f s without the slow mark" % SLOW_TEST_S)
        for duration, nodeid in long:
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}  (mark it @pytest.mark.slow)")


def pytest_collection_finish(session):
    # Everything alive after collection (torch, every test module) lives to the end of the session: moving it
    # out of the collector's reach makes each later gc.collect() (gpc.destroy() runs one) read only what the
    # tests themselves made.
    gc.collect()
    gc.freeze()
