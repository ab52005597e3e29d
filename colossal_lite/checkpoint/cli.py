"""``colossal-lite ckpt info PATH``, ``ckpt export PATH OUT [--ema] [--hf CONFIG]`` and ``ckpt merge PATH OUT``.

``register(subparsers)`` adds the ``ckpt`` command to a parser; ``run(args)`` executes it. Also
runnable alone: ``python -m colossal_lite.checkpoint.cli info PATH``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..pipe_exit import quiet_on_broken_pipe
from .hf_export import describe, export_hf
from .info import checkpoint_info
from .io import CheckpointError, atomic_save, format_bytes, tensor_bytes
from .layout import META_FILE, POINTERS
from .pointers import read_pointer
from .reader import merge_checkpoint as merged_content
from .weights import read_weights

DESCRIPTION = "Inspect a checkpoint, export its model weights, or merge a sharded one into one file."


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``ckpt info``, ``ckpt export`` and ``ckpt merge`` to ``subparsers`` (from ``parser.add_subparsers()``)."""
    p = subparsers.add_parser("ckpt", help="inspect, export or merge a checkpoint",
                              description=DESCRIPTION)
    _add_commands(p.add_subparsers(dest="ckpt_command", required=True))
    return p


def _add_commands(sub) -> None:
    info = sub.add_parser("info", help="what a checkpoint holds: epoch, step, metrics, config summary, sizes")
    info.add_argument("path", help="a checkpoint folder, a last/best pointer, a checkpoint directory (shows its "
                                   "last), a merged file or a save_checkpoint file; exits 1 when its files differ from "
                                   "the checksums it records")
    export = sub.add_parser("export", help="write the bare model weights (a state_dict) for inference")
    export.add_argument("path", help="a checkpoint folder (sharded ones too), pointer, checkpoint directory, merged "
                                     "file or save_checkpoint file")
    export.add_argument("out", help="output file, loadable with torch.load(out, weights_only=True); with --hf an "
                                    "output folder for from_pretrained")
    export.add_argument("--ema", action="store_true",
                        help="write the EMA average an EMAHook kept instead of the live (training) weights")
    export.add_argument("--ema-hook", metavar="KEY", default=None,
                        help="with several EMAHooks: the one whose average to write, e.g. EMAHook.1 (implies --ema)")
    export.add_argument("--hf", metavar="CONFIG", default=None,
                        help="write a Hugging Face model folder (save_pretrained) instead of a file: CONFIG is the "
                             "model's config.json or a folder holding one (needs transformers)")
    export.add_argument("--hf-class", metavar="NAME", default=None,
                        help="with --hf: the transformers model class, e.g. GPT2LMHeadModel (default: the config's "
                             "'architectures')")
    merge = sub.add_parser("merge", help="turn a sharded (zero stage 2/3) checkpoint into one file that resumes with "
                                         "any number of ranks and any zero stage")
    merge.add_argument("path", help="a checkpoint folder, pointer or checkpoint directory written by a sharded run")
    merge.add_argument("out", help="output file: the whole checkpoint with full model and optimizer tensors; "
                                   "resume with fit(resume_from=OUT) or LoadCheckpointHook(OUT)")


def _short(value: Any, width: int = 70) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 3] + "..."


def format_info(info: Dict[str, Any]) -> str:
    """The text ``ckpt info`` prints."""
    lines = [f"checkpoint: {info['path']}" + (f"  ({', '.join(info['pointers'])})" if info.get("pointers") else "")]
    if info.get("merged_from"):
        lines.append(f"  merged from: {info['merged_from']} (resumes with any number of ranks and any zero stage)")
    lines.append(f"  epoch: {info.get('epoch')}   step: {info.get('step')}")
    metrics = info.get("metrics") or {}
    lines.append("  metrics: " + (", ".join(f"{k}={_short(v, 30)}" for k, v in metrics.items()) or "none"))
    version = info.get("version") or "unknown"
    lines.append(f"  written by: colossal_lite {version}, torch {info.get('torch_version') or 'unknown'}"
                 + (f", {info['world_size']} rank(s)" if info.get("world_size") else "")
                 + (f", {info['created_utc']} UTC" if info.get("created_utc") else ""))
    config = info.get("config")
    if isinstance(config, dict) and config:
        lines.append("  config:")
        for k, v in config.items():
            lines.append(f"    {k} = {_short(v)}")
    else:
        lines.append("  config: none recorded")
    if info.get("checksums"):
        lines.append(f"  checksums: {info['checksums']}")
    lines.append(f"  files ({format_bytes(info['total_bytes'])} in all):")
    width = max([16, *map(len, info["files"])])
    for name, n in info["files"].items():
        lines.append(f"    {name:<{width}} {format_bytes(n):>10}")
    entries = info.get("entries") or {}
    if entries:
        sharded = info.get("sharded_bytes")
        lines.append("  tensor data by entry" + ("" if sharded is None else
                     f" (the model and optimizer state are in sharded/, {format_bytes(sharded)}, not below)") + ":")
        for name, n in entries.items():
            lines.append(f"    {name:<16} {format_bytes(n):>10}")
    return "\n".join(lines)


def _info(path: str) -> int:
    """Print what ``path`` holds; 1 when its files differ from what its ``meta.json`` records, so a script can
    use the command as a check."""
    info = checkpoint_info(path)
    print(format_info(info))
    return 1 if info.get("damaged") else 0


def check_out(path, out, one_file: bool = True) -> None:
    """Refuse an ``out`` that would replace what the command reads, a pointer, or any file of a checkpoint folder
    (its files are checksummed, and a checkpoint cleanup would delete what was written there); and, for a command
    that writes ``one_file``, a path written as a folder's (``runs/out/``: it would become a file of that name)."""
    if one_file and str(out).endswith(("/", os.sep)):
        raise CheckpointError(f"the output {out} ends in '/', but one file is written: give its name (e.g. "
                              f"{str(out).rstrip('/' + os.sep) or '.'}/model.pt)")
    target, source = Path(out), Path(path)
    if target.exists() and not (target.is_file() or target.is_dir()):  # (replaced by a rename: as root, a device too)
        raise CheckpointError(f"the output {out} is not a regular file (a pipe, a device or a socket): nothing was "
                              f"written; give a file path")
    if target.exists() and source.exists() and target.resolve() == source.resolve():
        raise CheckpointError(f"the output {out} is the checkpoint being read: nothing was written; give another "
                              f"output path")
    if target.name in POINTERS and target.is_file() and read_pointer(target) is not None:
        raise CheckpointError(f"the output {out} is a '{target.name}' pointer of the run in {target.parent}: "
                              f"nothing was written; give an output path outside the run's checkpoint folders")
    for folder in (target, *target.resolve().parents):
        if (folder / META_FILE).is_file():
            raise CheckpointError(f"the output {out} is inside the checkpoint folder {folder}: nothing was "
                                  f"written; give an output path outside the run's checkpoint folders")


def _export(path: str, out: str, ema=False, hf=None, hf_class=None) -> int:
    check_out(path, out, one_file=hf is None)
    if hf is not None:
        print(describe(export_hf(path, out, hf, hf_class, ema, progress=False)))
        return 0
    if hf_class is not None:
        raise ValueError("--hf-class names the model class of a Hugging Face export: give --hf CONFIG with it")
    weights = read_weights(path, ema)
    atomic_save(weights.state, out)
    what = "" if weights.steps is None else f" (the EMA weights of {weights.source}, {weights.steps} steps averaged)"
    print(f"wrote {len(weights.state)} tensors ({format_bytes(tensor_bytes(weights.state))}){what} of "
          f"{weights.read_from} to {out}; load "
          f"them with model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")
    return 0


def merge_checkpoint(path, out) -> dict:
    """Write the sharded checkpoint ``path`` names as one file ``out`` (see ``merged.py``); returns its content."""
    check_out(path, out)
    state = merged_content(path)
    atomic_save(state, out)
    return state


def _merge(path: str, out: str) -> int:
    state = merge_checkpoint(path, out)
    print(f"wrote {out}: {len(state['engine']['model'])} model tensors, {format_bytes(tensor_bytes(state))} in all; "
          f"resume from it with any number of ranks and any zero stage (fit(resume_from={str(out)!r}) or "
          f"LoadCheckpointHook), or export its weights with: colossal-lite ckpt export {out} model.pt")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``ckpt`` command; prints a one-line error and returns 1 when it fails."""
    try:
        if args.ckpt_command == "info":
            return _info(args.path)
        if args.ckpt_command == "export":
            return _export(args.path, args.out, args.ema_hook or args.ema, args.hf, args.hf_class)
        if args.ckpt_command == "merge":
            return _merge(args.path, args.out)
    except BrokenPipeError:
        raise  # the reader stopped early, nothing went wrong here: main() ends quietly (quiet_on_broken_pipe)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 2


@quiet_on_broken_pipe
def main(argv: Optional[List[str]] = None) -> int:
    """``info PATH``, ``export PATH OUT [--ema]`` or ``merge PATH OUT``; a leading ``ckpt`` (the words that follow
    ``colossal-lite``) is accepted too."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ckpt"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m colossal_lite.checkpoint.cli", description=DESCRIPTION)
    _add_commands(parser.add_subparsers(dest="ckpt_command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
