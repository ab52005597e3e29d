"""Run a script on N ranks the way torchrun's workers run, from one interpreter that imports torch once.

``python tests/rank_forker.py NPROC PORT SCRIPT [ARGS...]``: this process imports torch and colossal_lite, then
forks NPROC ranks. Each rank has the variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ..., MASTER_ADDR=127.0.0.1, MASTER_PORT=PORT) and runs SCRIPT as a
fresh ``__main__`` module with ``sys.argv == [SCRIPT, *ARGS]`` and the script's folder first on ``sys.path``, as
``python -u SCRIPT ARGS`` would. A rank ends the way an interpreter ends: ``SystemExit`` gives its status, an
uncaught exception prints its traceback and gives status 1, and exit handlers and finalization run. The ranks
write to this process's stdout and stderr, which are theirs too, as torchrun's workers write to its own.

``python tests/rank_forker.py --serve`` is the same launcher kept running: each launch it is sent becomes a fork of
it, so one pytest process pays for importing torch once for all its launches (``serve`` has the protocol;
``tests/dist_helpers.py`` is its client).

This process also keeps the job's store for the whole launch, as torchrun's agent does
(``TORCHELASTIC_USE_AGENT_STORE=True``): the ranks are its clients, and a script that destroys its process group
and makes a new one takes the same path as under torchrun.

Like torchrun, once a rank fails the others are stopped (SIGTERM, then SIGKILL after ``STOP_GRACE_S``), each
failed rank is named on stderr and the exit status is 1; it is 0 when every rank exits 0.

What it does not do, so tests whose subject is one of these stay on torchrun (``tests/dist_helpers.py`` lists
them): no agent, no ``TORCHELASTIC_*`` variables but the agent store's (so
``colossal_lite.launch.under_torchrun()`` is False), no restarts, no forwarding of signals sent to this process.
"""
import builtins
import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import time
import types

import torch  # noqa: F401  imported once here, before the forks: this is what the ranks do not pay for again
import torch._dynamo  # noqa: F401  DDP imports it
import torch.distributed  # noqa: F401

import colossal_lite  # noqa: F401
import colossal_lite.trainer  # noqa: F401

STOP_GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL when it stops the workers of a failed job
POLL_S = 0.02
STACKS_S = 0.3  # for one rank to print its stacks before the next is asked


def torchrun_env(rank: int, nproc: int, port: int) -> dict:
    """The variables torchrun's agent gives worker ``rank`` of a one-node job of ``nproc`` workers."""
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, GROUP_RANK=0, GROUP_WORLD_SIZE=1,
               ROLE_RANK=rank, ROLE_WORLD_SIZE=nproc, ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               TORCHELASTIC_USE_AGENT_STORE=True)
    return {k: str(v) for k, v in env.items()}


def run_as_main(script: str, args) -> None:
    """Run ``script`` as ``python script args`` would, in this (forked) process; raise ``SystemExit`` at its end."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = script, builtins, None
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    try:
        exec(code, vars(main))
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: the status, or death by SIGINT
    except BaseException:  # noqa: BLE001  what an interpreter does with an uncaught exception
        kind, error, tb = sys.exc_info()
        error.__traceback__ = tb.tb_next  # the script's frames only, as in a traceback of `python script`
        sys.excepthook(kind, error, tb.tb_next)
        raise SystemExit(1) from None
    raise SystemExit(0)


def fresh_random_state() -> None:
    """numpy's global generator, seeded from the OS when numpy was imported here, would otherwise be the same in
    every rank; in a new interpreter it is each process's own (Python's ``random`` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def start_rank(rank: int, nproc: int, port: int, script: str, args, listener: socket.socket) -> int:
    pid = os.fork()
    if pid == 0:  # the rank: its SystemExit leaves through this module's top level, a normal interpreter exit
        listener.close()  # the job's store is this process's, not the rank's
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # its Python stacks, asked for at a timeout
        fresh_random_state()
        os.environ.update(torchrun_env(rank, nproc, port))
        run_as_main(script, args)
    return pid


def ask_for_stacks(pids: dict) -> None:
    """Each rank in turn prints its Python stacks (SIGUSR1 to this process asks, at a test's timeout), so the
    ranks' stacks do not interleave."""
    for pid, rank in list(pids.items()):
        sys.stderr.write(f"rank_forker: the Python stacks of rank {rank} (pid {pid})\n")
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        time.sleep(STACKS_S)


def stop(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def wait_all(pids: dict) -> dict:
    """``{rank: exit code}`` (``-signal`` for a rank killed by a signal); stops the rest once one fails."""
    codes, running, kill_at = {}, dict(pids), None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(POLL_S)
            if kill_at is not None and time.monotonic() > kill_at:
                for other in running:
                    os.kill(other, signal.SIGKILL)
                kill_at = float("inf")
            continue
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and kill_at is None:
            stop(running)
            kill_at = time.monotonic() + STOP_GRACE_S
    return codes


def main(argv) -> int:
    nproc, port, script, args = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    gc.freeze()  # the ranks leave what was imported here to the OS at exit instead of collecting it
    pids = {}
    signal.signal(signal.SIGUSR1, lambda signum, frame: ask_for_stacks(pids))  # each rank puts faulthandler's instead
    # the job's store, kept here for the whole launch as torchrun's agent keeps it, so a script that makes its process
    # group anew finds the store it did before. Its socket listens before the forks, so each rank's first connection
    # waits in the backlog instead of failing and sleeping in the client's retry; the store itself (and its thread)
    # starts after them, as no thread may run in a process that forks
    listener = socket.create_server(("127.0.0.1", port), backlog=max(16, 4 * nproc))
    for rank in range(nproc):
        pids[start_rank(rank, nproc, port, script, args, listener)] = rank
    store = torch.distributed.TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
                                       master_listen_fd=listener.detach())
    codes = wait_all(pids)
    del store
    failed = {rank: code for rank, code in sorted(codes.items()) if code != 0}
    for rank, code in failed.items():
        how = f"signal {-code}" if code < 0 else f"status {code}"
        sys.stderr.write(f"rank_forker: rank {rank} of {script} exited with {how}\n")
    return 1 if failed else 0


def serve() -> None:
    """``--serve``: stay up with torch imported and run launch after launch, each as a fork of this process.

    Each request is one JSON line on stdin: ``{"id": N, "argv": [NPROC, PORT, SCRIPT, *ARGS], "env": {...},
    "cwd": ..., "stdout": PATH, "stderr": PATH}``. The launch becomes what ``python rank_forker.py NPROC PORT
    SCRIPT ARGS`` started with that environment, folder and output files would be: a process of its own session (so the caller
    can stop it and its ranks together) whose ranks exit as an interpreter does. With ``"argv": [SCRIPT, *ARGS]`` and
    ``"plain": true`` the launch is ``python SCRIPT ARGS`` itself, one process without torchrun's variables.
    The answers are JSON lines on stdout: ``{"id": N, "pid": PID}`` at once, then
    ``{"id": N, "status": CODE, "cpu": SECONDS}`` when the launch has ended (the CPU seconds of it and its ranks,
    which the caller's own accounting of its children cannot see). It ends when stdin closes. The caller sends only
    launches whose start-up environment equals this process's: variables read while the interpreter or torch
    starts cannot change after the fork.
    """
    gc.freeze()
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the launches' fd 1 becomes their output file
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            become_launch(request)
            if request.get("plain"):
                faulthandler.register(signal.SIGUSR1, all_threads=True)  # its Python stacks, asked for at a timeout
                fresh_random_state()
                run_as_main(request["argv"][0], request["argv"][1:])
            leave(main(request["argv"]))
        replies.write(json.dumps(dict(id=request.get("id"), pid=pid)) + "\n")
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps(dict(id=request.get("id"), status=os.waitstatus_to_exitcode(status),
                                      cpu=usage.ru_utime + usage.ru_stime)) + "\n")


def leave(status: int) -> None:
    """The launching process's own end, after its ranks': flush its output and exit without the interpreter's
    teardown. It stands for torchrun's agent, whose teardown no test looks at; the ranks, which are the tests'
    subject, end as an interpreter ends. In a fork of the server that teardown is a large share of a short launch's
    CPU: it writes reference counts into every page the fork shares with the server, so the kernel copies each one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def become_launch(request: dict) -> None:
    """In the fork of ``serve``: the session, folder, environment and standard streams of a new launch."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):  # first, so what fails below is reported there
        # O_APPEND: each write of every rank lands whole at the end, as it would in a pipe
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        leave(main(sys.argv[1:]))
