"""The ``last``/``best`` pointer files on disk, and finding the checkpoint folder a path or a pointer names.

A pointer is a small text file holding the name of a folder beside it; it is replaced atomically,
so it always names a complete checkpoint. Which checkpoint a pointer should name is policy
(``policy.py``); this module only reads and writes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .io import CheckpointNotFoundError, PathLike, atomic_write_text
from .layout import META_FILE, POINTERS, newest_checkpoint, read_meta

POINTER_MAX_BYTES = 4096  # a larger file is a checkpoint file, never a pointer


def read_pointer(pointer: Path) -> Optional[str]:
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or "/" in text or "\\" in text or text.startswith("."):
        return None  # not a name we wrote: never follow it outside the folder
    return text


def why_not_followed(pointer: Path) -> str:
    """Why ``read_pointer`` gives None for ``pointer``, in words that end an error message: missing, unreadable,
    empty, or naming a path rather than a folder beside it."""
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return f"{pointer} does not exist"
    except (OSError, UnicodeDecodeError) as e:
        return f"{pointer} cannot be read as a pointer ({type(e).__name__}: {e})"
    if not text:
        return f"{pointer} is empty"
    # a pointer holds the bare name of a folder beside it; a path ('../x', 'a/b', '.hidden') could lead anywhere,
    # so it is never followed, even to a folder that exists
    bare = Path(text.replace("\\", "/")).name
    example = f" (here {bare!r})" if bare and not bare.startswith(".") else ""
    return (f"{pointer} names {text!r}, not the bare name of a folder in {pointer.parent} (it holds a '/' or a "
            f"'\\', or starts with '.'), and such a pointer is never followed: it could lead outside the folder. "
            f"Write the checkpoint folder's bare name into it{example}, or give the folder's path instead")


def write_pointer(pointer: Path, name: str) -> None:
    atomic_write_text(pointer, name + "\n")


def pointer_target(path: Path) -> Optional[Path]:
    """The checkpoint folder the file ``path`` points to, or None when the file is no pointer: a pointer is a
    small file naming a folder beside it, so any other file (a checkpoint file, a note) is taken as a file.
    A ``last``/``best`` file naming a folder that is gone raises, naming both."""
    name = read_pointer(path) if path.stat().st_size < POINTER_MAX_BYTES else None
    if name is None:
        return None
    target = path.parent / name
    if target.is_dir():
        return target
    if path.name in POINTERS:
        raise CheckpointNotFoundError(f"{path} points to {name}, which is not in {path.parent} (removed by hand?): "
                                      f"give one of the checkpoint folders there instead")
    return None


def is_single_file(path: PathLike) -> bool:
    """True for a single-file checkpoint (``save_checkpoint``, ``ckpt merge``) or another file given as one,
    False for folders and ``last``/``best`` pointers."""
    p = Path(path)
    return p.is_file() and pointer_target(p) is None


def _run_checkpoint(folder: Path) -> Path:
    """The checkpoint a folder of a run's checkpoints stands for: its ``last``, else (saved with
    ``save_last=False``) its newest complete checkpoint, as ``resume_from='auto'`` picks it. ``folder`` itself
    when it holds neither (``read_meta`` then says what it lacks)."""
    target = read_pointer(folder / "last") if (folder / "last").is_file() else None
    if target is not None:
        return folder / target
    return newest_checkpoint(folder) or folder


def resolve_path(which: PathLike, checkpoint_dir: Optional[PathLike] = None) -> Path:
    """A checkpoint folder from a folder path, a ``last``/``best`` pointer file, a checkpoint directory
    (its ``last``, else its newest complete checkpoint) or a name inside ``checkpoint_dir``; a single file (``ckpt merge``'s) is returned as it is."""
    candidates = [Path(which)]
    if checkpoint_dir is not None and not Path(which).is_absolute() and Path(which) != Path(checkpoint_dir):
        candidates.append(Path(checkpoint_dir) / which)  # a checkpoint's name (not the folder itself, again)
    for path in candidates:
        if path.is_file():
            target = pointer_target(path)
            if target is None:
                return path  # a single file: read_checkpoint takes one ckpt merge wrote, and says what to do with others
            path = target
        if path.is_dir():
            if not (path / META_FILE).exists():
                path = _run_checkpoint(path)
            read_meta(path)
            return path
    pointer = Path(which)
    if pointer.name == "best" and (pointer.parent / "last").is_file():
        raise CheckpointNotFoundError(f"checkpoint {which} does not exist: the run in {pointer.parent} kept no 'best' "
                                      f"pointer (it was saved without SaveCheckpointHook(..., save_best=...)); give "
                                      f"{pointer.parent / 'last'} or one of its checkpoint folders")
    raise CheckpointNotFoundError(f"checkpoint {which} does not exist"
                                  + (f" (also looked for {candidates[1]})" if len(candidates) > 1 else ""))
