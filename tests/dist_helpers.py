"""Start real processes for distributed tests: N ranks with gloo on 127.0.0.1, a free port, a timeout; and read
the python blocks of a docs page that such tests run.

``run_ranks`` starts the ranks of most tests: it gives them torchrun's environment but forks them from one
interpreter that imported torch once (``tests/rank_forker.py``). Tests whose subject is torchrun, or a command
users run with torchrun, start real torchrun (``run_torchrun`` or their own command line):

- test_launch.py::test_two_processes_under_torchrun: launch_from_torch joins the store of torchrun's agent;
- test_multinode.py: elastic agents on two nodes and a restart;
- test_interrupt_under_torchrun.py and checkpoint/test_preemption.py (their torchrun command lines): signals, exit
  statuses and restarts through the agent;
- examples/test_digits_example.py: the README's first command, the digits example under torchrun.

The other examples and the docs' multi-rank snippets run on ``run_ranks``: their subject is what the script does
on two ranks, which the forked ranks run as torchrun's workers would (each rank starting torch again cost the
suite about 9 s of CPU per launch).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from colossal_lite.core import global_context as gpc

REPO = Path(__file__).resolve().parents[1]
STACKS_S = 2.0  # for the ranks of a launch that timed out to print their Python stacks
TERMINATE_GRACE_S = 40.0  # torchrun waits 30 s for its workers to stop after SIGTERM before it kills them
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_launch_context(monkeypatch):
    """For a fixture (``yield from``): no torchrun variables and no launch before and after the test; its process
    group destroyed."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    gpc.destroy()
    yield
    gpc.destroy()
    assert not dist.is_initialized()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k in TORCHRUN_VARS:
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def _run(cmd, timeout: float, env, cwd) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, or fail at ``timeout`` with its output. A timed-out process is asked to stop
    (SIGTERM, which torchrun passes on to its workers, each in a session of its own) before it is killed, so
    that no worker of a hung test runs on beside the rest of the suite."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\nstdout:\n{out}\n"
                                 f"stderr:\n{err}") from None
        finally:
            if proc.returncode is None:  # an error here (pytest-timeout's, a Ctrl-C): nothing runs on
                proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_torchrun(script, args: Sequence[str] = (), nproc: int = 2, timeout: float = 120, env=None, cwd=None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node nproc script args``; asserts exit 0 when ``check``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *map(str, args)]
    proc = _run(cmd, timeout, _env(env), cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run_ranks(script, args: Sequence[str] = (), nproc: int = 2, timeout: float = 120, env=None, cwd=None,
              check: bool = True) -> subprocess.CompletedProcess:
    """``script args`` on ``nproc`` ranks with the environment torchrun gives its workers, forked from an
    interpreter that imported torch once (``tests/rank_forker.py`` says what it does and does not do like torchrun).

    That interpreter is this pytest process's rank server, started at the first call and forked for each launch,
    unless the launch's environment differs from the server's in a variable read at start-up (``STARTUP_VARS``):
    then a fresh ``python tests/rank_forker.py`` runs it. Either way the test sees the same thing.

    Output, exit status (1 when a rank failed), ``check`` and ``timeout`` as ``run_torchrun``; at a timeout every
    rank prints its Python stacks before it is killed, and the error shows all the ranks' output. Tests whose subject
    is torchrun itself stay on ``run_torchrun`` (the module's docstring lists them).
    """
    cmd = ranks_command(script, args, nproc)
    env, cwd = _env(env), cwd or REPO
    server = _rank_server()
    proc = server.run(cmd, timeout, env, cwd) if server.serves(env) else _run_group(cmd, timeout, env, cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def ranks_command(script, args: Sequence[str] = (), nproc: int = 2) -> List[str]:
    """The command line of a launch of ``run_ranks`` in an interpreter of its own (``tests/rank_forker.py``), for a
    test that runs it under a prefix of its own (a namespace): one interpreter imports torch, where torchrun's
    agent and each of its workers would."""
    return [sys.executable, str(REPO / "tests" / "rank_forker.py"), str(nproc), str(free_port()), str(script),
            *map(str, args)]


# Variables the interpreter, the C runtime, OpenMP or torch read as they start: a fork of the rank server keeps
# the server's values, so a launch that sets them otherwise needs an interpreter of its own
STARTUP_VARS = re.compile(r"PYTHON|LD_|MALLOC_|GLIBC_TUNABLES$|OMP_|GOMP_|KMP_|MKL_|TORCH|PYTORCH_|CUDA|NCCL_|"
                          r"LANG$|LC_|TMPDIR$|TEMP$|TMP$")
# ... but not these, which match the pattern and are read only when used, after the fork has the launch's
# environment. torch writes the inductor's cache folder into this process's environment at its first compile, so
# counting it would send every later launch of the worker to a fresh interpreter.
READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
# Importing scikit-learn (the digits data of many tests) sets these OpenMP variables in this process's environment.
# Set from the start, the rank server has them too, so the launches after a test that imported it are still forks
# of the server instead of each starting torch again.
SKLEARN_SETS = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
for _name, _value in SKLEARN_SETS.items():
    os.environ.setdefault(_name, _value)
SERVER_START_S = 120.0  # for the server to import torch and answer, on a loaded machine
_servers: Dict[int, "_RankServer"] = {}  # by pid: a process forked from pytest needs a server of its own
_servers_lock = threading.Lock()
CHILD_CPU_S = [0.0]  # the CPU seconds of the launches the server ran, which this process's children's do not hold


def _rank_server() -> "_RankServer":
    with _servers_lock:
        server = _servers.get(os.getpid())
        if server is None or not server.alive():
            server = _servers[os.getpid()] = _RankServer(_env())
            atexit.register(server.close)
        return server


class _RankServer:
    """``python tests/rank_forker.py --serve``: runs each launch as a fork of itself (the protocol is there)."""

    def __init__(self, env: Dict[str, str]):
        self.env, self.sent, self.unread, self.busy = env, 0, b"", threading.Lock()
        # its own errors go to a file of its own: the stderr of the test that started it is captured and then gone
        self.log = tempfile.NamedTemporaryFile(prefix="rank_server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "rank_forker.py"), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     cwd=REPO, start_new_session=True)  # a signal to pytest's group is not for it

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, env: Dict[str, str]) -> bool:
        changed = set(env) ^ set(self.env) | {k for k in env.keys() & self.env.keys() if env[k] != self.env[k]}
        return not any(STARTUP_VARS.match(name) for name in changed - READ_WHEN_USED)

    def run(self, cmd, timeout: float, env, cwd, plain: bool = False) -> subprocess.CompletedProcess:
        """``cmd`` (``python rank_forker.py ...``, or ``python SCRIPT ...`` when ``plain``) as a fork of the server;
        launches asked for from several threads at once run one after the other."""
        with self.busy, tempfile.TemporaryDirectory(prefix="run_ranks-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            self.sent += 1
            request = dict(id=self.sent, argv=cmd[1 if plain else 2:], plain=plain, env=env, cwd=str(cwd),
                           stdout=str(out), stderr=str(err))
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            started = self._answer("pid", SERVER_START_S)
            if started is None:
                self.close()
                raise AssertionError(f"the rank server did not start {' '.join(cmd)} within {SERVER_START_S} s"
                                     f"\n{self.errors()}")
            pid, ended = started["pid"], None
            try:
                ended = self._answer("status", timeout)
                if ended is None:
                    os.kill(pid, signal.SIGUSR1)  # the ranks' stacks, written from signal handlers
                    time.sleep(STACKS_S)
                    _kill_group(pid)
                    ended = self._answer("status", SERVER_START_S)
                    raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\nstdout:\n"
                                         f"{_read(out)}\nstderr:\n{_read(err)}")
            finally:
                if ended is None:  # an error here (pytest-timeout's, a Ctrl-C): no rank runs on
                    _kill_group(pid)
                    if self._answer("status", SERVER_START_S) is None:
                        self.close()
            CHILD_CPU_S[0] += ended["cpu"]
            return subprocess.CompletedProcess(cmd, ended["status"], _read(out), _read(err))

    def _answer(self, key: str, timeout: float) -> Optional[dict]:
        """The server's answer ``key`` to the last request, or None when it does not come within ``timeout``
        (an answer to an earlier request, abandoned at an error, is passed over)."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self.unread:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"the rank server (tests/rank_forker.py --serve) ended with status "
                                       f"{self.proc.wait()}\n{self.errors()}")
                self.unread += chunk
            line, self.unread = self.unread.split(b"\n", 1)
            answer = json.loads(line)
            if answer.get("id") == self.sent and key in answer:
                return answer

    def errors(self) -> str:
        return f"its log {self.log.name}:\n{Path(self.log.name).read_text(errors='replace')[-3000:]}"

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()  # the server ends at the end of its input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the launch and its ranks are gone already
        pass


def _read(path: Path) -> str:
    """A launch's output as ``subprocess`` reads it with ``text=True``."""
    return path.read_text() if path.exists() else ""


def _run_group(cmd, timeout: float, env, cwd) -> subprocess.CompletedProcess:
    """``_run`` for rank_forker, which starts processes of its own: it and they form a session. At the timeout it
    is asked for its ranks' stacks (SIGUSR1), and then the whole session is killed."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            try:
                proc.communicate(timeout=STACKS_S)  # the stacks, written from signal handlers
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\nstdout:\n{out}\n"
                                 f"stderr:\n{err}") from None
        finally:
            _signal_group(proc, signal.SIGKILL)  # after an error here (pytest-timeout's, a Ctrl-C) no rank runs on
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if proc.returncode is None:  # not reaped yet, so its process group still exists
        os.killpg(proc.pid, signum)


def run_python(script, args: Sequence[str] = (), timeout: float = 120, env=None, cwd=None,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python script args`` as one process without torchrun's variables: a fork of this pytest process's rank
    server (``run_ranks``), or a fresh interpreter when the start-up environment differs from the server's. Tests
    whose subject is what an interpreter imports or does as it starts run their own command line instead."""
    cmd = [sys.executable, str(script), *map(str, args)]
    env, cwd = _env(env), cwd or REPO
    server = _rank_server()
    proc = server.run(cmd, timeout, env, cwd, plain=True) if server.serves(env) else _run(cmd, timeout, env, cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def doc_python_blocks(page, section: Optional[str] = None) -> List[str]:
    """The ```python blocks of a docs page (a path under the repository), or of its section whose heading is
    ``section`` (up to the next heading of the same or a higher level; '#' lines inside code blocks are code)."""
    blocks, block, fence, inside, level = [], None, False, section is None, 0
    for line in (REPO / page).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
            if inside and fence and line.strip() == "```python":
                block = []
            elif inside and not fence and block is not None:
                blocks.append("".join(block))
                block = None
            continue
        if fence:
            if block is not None:
                block.append(line)
            continue
        heading = re.match(r"(#+) (.*)", line)
        if heading and section is not None:
            if heading.group(2).strip() == section:
                inside, level = True, len(heading.group(1))
            elif inside and len(heading.group(1)) <= level:
                break
    return blocks
