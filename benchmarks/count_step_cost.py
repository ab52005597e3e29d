"""Per-micro-step work of the engine and the Trainer against the hand-written loop, counted, not timed.

``bench_engine.py`` times the contestants; on a shared machine its figures move by tens of us between
processes (heap layout, neighbours' use of the shared cache). This script counts instead: it runs the same
contestants (same workload, same hooks, progress on) under valgrind's callgrind with a cache model and
reports, per micro-step, the instructions executed (Ir), the level-1 instruction and data cache misses and
the misses of a last-level cache (2 MiB by default; at bench_engine's width the model's kernels flush an L2
of that size between two steps). Counts repeat within about 0.5 % of the hand loop's total (a few thousand instructions per
micro-step), so a change of the Trainer's overhead shows up in one run. Python's cyclic garbage collector is
collected before each counted stretch and off during it: where its collections land would move a count by up to
~10 k instructions per micro-step between runs.

The two Trainer contestants (``trainer``, and ``trainer+speed`` with ``SpeedReportHook()``) are also counted over
a fit twice as long, in the same process: the difference of the two lengths is their work per micro-step, what is
left of the shorter fit their work per fit (its start, epoch end, the report). Both are printed, and the hook's
share of each (``SpeedReportHook per micro-step`` / ``per fit``).

    python benchmarks/count_step_cost.py [--steps 200] [--width 128] [--ll-kib 2048] [--keep-dumps DIR]
                                         [--nonfinite-loss raise|skip|ignore] [--parts]
    python benchmarks/count_step_cost.py --bytecodes [--diff A,B] [--steps 200] [--width 128]

``--parts`` counts, instead, the Trainer with each of its parts alone (no hook; LossHook; AccuracyHook;
LRSchedulerHook; LogMetricByStepHook; the progress display; all of them; all with ``SpeedReportHook``, with and
without its breakdown), each over fits of n and 2n micro-steps: what each part adds per micro-step.

``--bytecodes`` runs the same parts without valgrind (seconds) and counts the Python bytecodes each function runs
(``sys.settrace``): the interpreter's share of a part, which is nearly all of what a hook adds, attributed by
function (``--diff all,all+speed`` lists the functions one part adds over another). Bytecodes are not equally
costly (a call costs more than a load), so use it to aim a cut and callgrind to size it.

It counts what runs in the process, not the kernel's work for it: page faults (a heap that glibc trims and
grows again every step) cost no instruction here; ``bench_engine.py`` prints them per contestant.
``--width 512 --ll-kib 1024 --steps 100`` counts bench_engine's own workload with a last level the size of
this machine's L2, so the kernels flush it as they do there (about 25 minutes).

It needs valgrind, a C compiler and valgrind's ``callgrind.h`` (it builds a 2-function library that
switches counting on and off around each contestant). One run takes about 10 minutes at width 128 on a calm
machine (40 and more beside other engineers' work). The
estimate ``cycles ~ Ir + 12 x L1 misses + 40 x LL misses`` is a rough guide to what the counts cost.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
_TOGGLE_C = r"""
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void count_stop(const char *name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""
_INNER = "COLOSSAL_LITE_COUNT_INNER"  # set in the process valgrind runs: it holds the toggle library's path
CONTESTANTS = ("hand", "hand+", "engine", "trainer", "trainer+speed")  # +speed: with SpeedReportHook()
#: The two Trainer contestants again over a fit twice as long: the difference of the two lengths is the work per
#: micro-step, what is left the work of a fit (start, epoch end, the report).
LONG = {"trainer": "trainer@2x", "trainer+speed": "trainer+speed@2x"}
COUNTED = CONTESTANTS + tuple(LONG.values())
#: ``--parts``: the Trainer with one part at a time -> (bench_engine's hook names, progress, SpeedReportHook's
#: arguments or None). Each is counted over fits of n and 2n micro-steps; the hand loop over n.
PARTS = {
    "none": ((), False, None),
    "loss": (("loss",), False, None),
    "acc": (("acc",), False, None),
    "lr": (("lr",), False, None),
    "step": (("step",), False, None),
    "progress": ((), True, None),
    "all": (("loss", "acc", "lr", "step"), True, None),
    "all+speed": (("loss", "acc", "lr", "step"), True, {}),
    "all+speed-nobreakdown": (("loss", "acc", "lr", "step"), True, {"breakdown": False}),
}
PARTS_COUNTED = ("hand",) + tuple(f"{name}@{length}" for name in PARTS for length in ("1x", "2x"))
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


@contextlib.contextmanager
def _collector_off():
    """Python's cyclic garbage collector collected before and off inside: where its collections land moves a
    contestant's count by up to ~10 k instructions per micro-step from one run (or one code change) to the next,
    which would hide the differences this script is for."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def _counted(lib, name: str):
    """Count what runs inside under ``name`` (callgrind), the garbage collector off."""
    with _collector_off():
        lib.count_start()
        try:
            yield
        finally:
            lib.count_stop(name.encode())


def _run_parts(steps: int, width: int, nonfinite_loss: str, counted) -> None:
    """The Trainer with each part of ``PARTS`` alone (a Trainer of its own each), warmed up by one fit, then run
    over fits of ``steps`` and ``2 * steps`` micro-steps inside ``counted(name)`` (a context manager); the hand
    loop over ``steps`` micro-steps, as ``'hand'``."""
    import torch

    sys.path.insert(0, HERE)
    import bench_engine as be

    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import SpeedReportHook

    torch.set_num_threads(1)
    batches = be.Workload(in_features=width, hidden=width).batches()
    loaders = {"1x": [batches[i % len(batches)] for i in range(steps)],
               "2x": [batches[i % len(batches)] for i in range(2 * steps)]}
    hand, _ = be.build_hand(be.Workload(in_features=width, hidden=width, nonfinite_loss=nonfinite_loss))
    runs = []
    for name, (hook_names, progress, speed) in PARTS.items():
        w = be.Workload(in_features=width, hidden=width, hooks=hook_names, progress=progress,
                        nonfinite_loss=nonfinite_loss)
        engine, _, hook_list = be.trainer_setup(w)
        runs.append((name, Trainer(engine), hook_list + ([] if speed is None else [SpeedReportHook(report=False,
                                                                                                    **speed)]),
                     progress))
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        for batch in loaders["1x"]:
            hand(batch)
        with counted("hand"):
            for batch in loaders["1x"]:
                hand(batch)
        for name, trainer, hook_list, progress in runs:
            trainer.fit(loaders["1x"], epochs=1, hooks=hook_list, display_progress=progress)  # warm-up
            for length, loader in loaders.items():
                with counted(f"{name}@{length}"):
                    trainer.fit(loader, epochs=trainer.cur_epoch + 1, hooks=hook_list, display_progress=progress)


def _inner_parts(steps: int, width: int, nonfinite_loss: str) -> None:
    """Under valgrind, ``--parts``: each part counted by callgrind."""
    lib = ctypes.CDLL(os.environ[_INNER])
    _run_parts(steps, width, nonfinite_loss, lambda name: _counted(lib, name))


Code = Tuple[str, int, str]  # a Python function: (file, first line, name)


def _count_bytecodes(steps: int, width: int, nonfinite_loss: str) -> Dict[str, Dict[Code, int]]:
    """``--bytecodes``: the Python bytecodes each part runs, by function (``sys.settrace`` with opcode events;
    the garbage collector off while counting, as under callgrind) -> {contestant: {function: bytecodes}}."""
    counts: Dict[str, Dict[Code, int]] = {}
    current: Dict[Code, int] = {}

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            current[key] = current.get(key, 0) + 1
        return trace

    @contextlib.contextmanager
    def counted(name: str):
        current.clear()
        with _collector_off():
            sys.settrace(trace)
            try:
                yield
            finally:
                sys.settrace(None)
        counts[name] = dict(current)

    _run_parts(steps, width, nonfinite_loss, counted)
    return counts


def _report_bytecodes(counts: Dict[str, Dict[Code, int]], n: int, diff: Optional[Tuple[str, str]]) -> None:
    """Bytecodes per micro-step of each part (fits of 2n less fits of n) and of the hand loop; with ``diff``
    ``(a, b)``, the functions whose bytecodes per micro-step differ most between b and a."""
    def per_step(name: str) -> Dict[Code, float]:
        if name == "hand":
            return {key: value / n for key, value in counts["hand"].items()}
        short, long = counts[f"{name}@1x"], counts[f"{name}@2x"]
        return {key: (long.get(key, 0) - short.get(key, 0)) / n for key in set(short) | set(long)}

    hand = sum(per_step("hand").values())
    none = sum(per_step("none").values())
    print(f"hand loop: {hand:.1f} Python bytecodes per micro-step")
    print(f"{'Trainer with':>24}  {'per micro-step':>14} {'vs hand':>9} {'vs none':>9}")
    for name in PARTS:
        total = sum(per_step(name).values())
        print(f"{name:>24}  {total:14.1f} {total - hand:+9.1f} {total - none:+9.1f}")
    if diff:
        a, b = (per_step(name) for name in diff)
        delta = {key: b.get(key, 0.0) - a.get(key, 0.0) for key in set(a) | set(b)}
        print(f"by function, {diff[1]} - {diff[0]} (bytecodes per micro-step):")
        for (path, line, name), value in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:30]:
            if abs(value) >= 0.5:
                print(f"  {value:+8.1f}  {os.path.basename(path)}:{line} {name}")


def _inner(steps: int, width: int, nonfinite_loss: str) -> None:
    """Under valgrind: warm every contestant up, then count each over ``steps`` micro-steps (the Trainer's
    also over ``2 * steps``, one fit each)."""
    import torch

    sys.path.insert(0, HERE)
    import bench_engine as be

    lib = ctypes.CDLL(os.environ[_INNER])
    torch.set_num_threads(1)
    w = be.Workload(in_features=width, hidden=width, nonfinite_loss=nonfinite_loss)
    steps_by_name, trainer, hook_list = be.build_shared(w, steps)
    batches = w.batches()
    loader = [batches[i % len(batches)] for i in range(steps)]
    long_loader = [batches[i % len(batches)] for i in range(2 * steps)]
    from colossal_lite.trainer.hooks import SpeedReportHook

    with_speed = hook_list + [SpeedReportHook()]
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        trainer.fit(loader, epochs=1, hooks=hook_list, display_progress=True)  # warm-up
        trainer.fit(loader, epochs=trainer.cur_epoch + 1, hooks=with_speed, display_progress=True)  # (FLOPs counted)
        for name in ("hand", "hand+", "engine"):
            for batch in loader:
                steps_by_name[name](batch)
        for name in COUNTED:
            if name.startswith("trainer"):
                hooks = with_speed if name.startswith("trainer+speed") else hook_list
                with _counted(lib, name):
                    trainer.fit(long_loader if name in LONG.values() else loader, epochs=trainer.cur_epoch + 1,
                                hooks=hooks, display_progress=True)
            else:
                step = steps_by_name[name]
                with _counted(lib, name):
                    for batch in loader:
                        step(batch)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise SystemExit(f"count_step_cost.py needs {tool} on PATH (apt install valgrind gcc); "
                         f"bench_engine.py measures time without it")
    return path


def _read_dumps(folder: str, names) -> Dict[str, List[int]]:
    counts = {}
    for path in glob.glob(os.path.join(folder, "callgrind.out.*")):
        name, totals = None, None
        with open(path) as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    name = line.split(": ", 3)[-1].strip()
                elif line.startswith("totals:"):
                    totals = [int(v) for v in line.split()[1:]]
        if name in names and totals:
            counts[name] = totals
    return counts


def _count(args) -> Dict[str, Dict[str, int]]:
    """Run the contestants under callgrind -> {contestant: {event: total count}}."""
    valgrind, cc = _need("valgrind"), _need("cc")
    with tempfile.TemporaryDirectory(prefix="count_step_cost_") as tmp:
        source, lib = os.path.join(tmp, "toggle.c"), os.path.join(tmp, "libtoggle.so")
        with open(source, "w") as f:
            f.write(_TOGGLE_C)
        built = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, source], capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"could not build the counting switch (is valgrind's callgrind.h installed?):\n"
                             f"{built.stderr}")
        env = dict(os.environ, **{_INNER: lib, "PYTHONHASHSEED": "0"})
        cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no", "--cache-sim=yes",
               "--I1=32768,8,64", "--D1=49152,12,64", f"--LL={args.ll_kib * 1024},16,64",
               f"--callgrind-out-file={os.path.join(tmp, 'callgrind.out.%p')}",
               os.path.realpath(sys.executable), os.path.abspath(__file__), "--steps", str(args.steps),
               "--width", str(args.width), "--nonfinite-loss", args.nonfinite_loss] + (["--parts"] if args.parts else [])
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        expected = PARTS_COUNTED if args.parts else COUNTED
        counts = _read_dumps(tmp, expected)
        if args.keep_dumps:
            os.makedirs(args.keep_dumps, exist_ok=True)
            for path in glob.glob(os.path.join(tmp, "callgrind.out.*")):
                shutil.copy(path, args.keep_dumps)
        if run.returncode != 0 or set(counts) != set(expected):
            raise SystemExit(f"the counted run failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return {name: dict(zip(EVENTS, totals)) for name, totals in counts.items()}


def _costs(c: Dict[str, int]) -> Tuple[float, float, float, float]:
    """(instructions, L1 misses, LL misses, ~cycles) of one dump's totals."""
    l1 = c["I1mr"] + c["D1mr"] + c["D1mw"]
    ll = c["ILmr"] + c["DLmr"] + c["DLmw"]
    return c["Ir"], l1, ll, c["Ir"] + 12 * l1 + 40 * ll


def _diff(a, b, scale: float = 1.0) -> str:
    return " ".join(f"{(x - y) / scale:+.0f}" for x, y in zip(a, b))


def _report(counts: Dict[str, Dict[str, int]], n: int) -> None:
    """Per micro-step rows of the contestants, then the Trainer's fits split into per micro-step and per fit."""
    totals = {name: _costs(c) for name, c in counts.items()}
    rows = {name: tuple(v / n for v in totals[name]) for name in CONTESTANTS}
    print(f"{'':>8}  {'Ir':>10} {'L1 miss':>9} {'LL miss':>8} {'~cycles':>10}   per micro-step (one fit of {n})")
    for name in CONTESTANTS:
        line = f"{name:>8}  " + " ".join(f"{v:{w}.0f}" for v, w in zip(rows[name], (10, 9, 8, 10)))
        print(line + ("" if name == "hand" else "   vs hand: " + _diff(rows[name], rows["hand"])))
    print("trainer vs hand+: " + _diff(rows["trainer"], rows["hand+"]) + " (Ir, L1, LL, ~cycles)")
    print("trainer+speed vs trainer: " + _diff(rows["trainer+speed"], rows["trainer"]) + " (Ir, L1, LL, ~cycles; "
          "the fit's own work spread over its micro-steps)")
    # a fit of 2n micro-steps less one of n: the work of n micro-steps; a fit of n less that: the fit's own work
    step = {name: tuple((a - b) / n for a, b in zip(totals[LONG[name]], totals[name])) for name in LONG}
    fit = {name: tuple(a - n * s for a, s in zip(totals[name], step[name])) for name in LONG}
    print(f"split from fits of {n} and {2 * n} micro-steps (Ir, L1, LL, ~cycles):")
    for name in LONG:
        print(f"  {name:>13}: per micro-step " + " ".join(f"{v:.0f}" for v in step[name]) +
              ", per fit " + " ".join(f"{v:.0f}" for v in fit[name]))
    print("  SpeedReportHook per micro-step: " + _diff(step["trainer+speed"], step["trainer"]))
    print("  SpeedReportHook per fit:        " + _diff(fit["trainer+speed"], fit["trainer"]))


def _report_parts(counts: Dict[str, Dict[str, int]], n: int) -> None:
    """Per micro-step instructions of the Trainer with each part alone (fits of 2n less fits of n), against the
    hand loop, and what each part adds to the Trainer with none."""
    hand = counts["hand"]["Ir"] / n
    step = {name: (counts[f"{name}@2x"]["Ir"] - counts[f"{name}@1x"]["Ir"]) / n for name in PARTS}
    fit = {name: counts[f"{name}@1x"]["Ir"] - n * step[name] for name in PARTS}
    print(f"hand loop: {hand:.0f} instructions per micro-step")
    print(f"{'Trainer with':>24}  {'per micro-step':>14} {'vs hand':>9} {'vs none':>9} {'per fit':>10}")
    for name in PARTS:
        print(f"{name:>24}  {step[name]:14.0f} {step[name] - hand:+9.0f} {step[name] - step['none']:+9.0f} "
              f"{fit[name] / 1e3:9.0f}k")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="micro-steps counted per contestant")
    parser.add_argument("--width", type=int, default=128, help="features of the MLP (512 is bench_engine's; slow here)")
    parser.add_argument("--ll-kib", type=int, default=2048, help="last-level cache size of the model, KiB")
    parser.add_argument("--keep-dumps", metavar="DIR", help="copy callgrind's dumps (one per contestant) into DIR, "
                                                          "for callgrind_annotate")
    parser.add_argument("--nonfinite-loss", default="raise", choices=("raise", "skip", "ignore"),
                        help="config nonfinite_loss of the engine and the Trainer ('ignore': without the loss guard)")
    parser.add_argument("--parts", action="store_true",
                        help="count the Trainer with each hook (and the progress display, SpeedReportHook) alone "
                             "instead: what each part adds per micro-step")
    parser.add_argument("--bytecodes", action="store_true",
                        help="--parts, counting Python bytecodes by function instead of running callgrind (seconds, "
                             "no valgrind): where the interpreter's work goes")
    parser.add_argument("--diff", metavar="A,B", help="with --bytecodes: the functions that differ most between two "
                                                     "of the parts (or 'hand'), e.g. all,all+speed")
    args = parser.parse_args()
    diff = tuple(args.diff.split(",")) if args.diff else None
    if diff and (len(diff) != 2 or not set(diff) <= set(PARTS) | {"hand"}):
        parser.error(f"--diff takes two of {', '.join(('hand',) + tuple(PARTS))}, comma-separated")
    if args.bytecodes:
        print(f"workload: MLP {args.width}->{args.width}->10, batch 64, accumulation 2, clip 1; the Trainer with one "
              f"part at a time over fits of {args.steps} and {2 * args.steps} micro-steps, Python bytecodes counted")
        _report_bytecodes(_count_bytecodes(args.steps, args.width, args.nonfinite_loss), args.steps, diff)
        return
    if _INNER in os.environ:
        (_inner_parts if args.parts else _inner)(args.steps, args.width, args.nonfinite_loss)
        return
    if args.ll_kib < 64 or args.ll_kib & (args.ll_kib - 1):
        parser.error("--ll-kib must be a power of two, at least 64")
    if args.steps < 20 or args.steps % 20:
        parser.error("--steps must be a multiple of 20 (the hand+ loop prints every tenth of its epoch)")
    counts = _count(args)
    if args.parts:
        print(f"workload: MLP {args.width}->{args.width}->10, batch 64, accumulation 2, clip 1; the Trainer with one "
              f"part at a time over fits of {args.steps} and {2 * args.steps} micro-steps, counted by callgrind")
        _report_parts(counts, args.steps)
        return
    print(f"workload: MLP {args.width}->{args.width}->10, batch 64, accumulation 2, clip 1; {args.steps} micro-steps "
          f"per contestant, counted by callgrind (L1 32/48 KiB, LL {args.ll_kib} KiB)")
    _report(counts, args.steps)


if __name__ == "__main__":
    main()
