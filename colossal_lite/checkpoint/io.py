"""Safe, atomic reading and writing of checkpoint files.

Only tensors and plain Python values are written (``to_plain`` checks and converts), and every
read goes through ``torch.load(..., weights_only=True, map_location="cpu")``, so loading a file
never runs code from it. Writes go to a temporary name in the same folder, are flushed and
fsynced, and then renamed into place, so a reader sees either the old file or the new one.
Each write also returns a CRC-32 of the bytes as they went to the file; a read given that
checksum compares it before unpickling, so a damaged file is reported as damaged. Such a read maps
the file into memory once: the CRC-32 is taken over the mapped pages, and ``torch.load(mmap=True)``
then builds the tensors on the same pages, so each byte is read from the disk once and no second
copy of the file is held in memory. A single file
(``save_checkpoint``, ``ckpt merge``) is checked against the CRC-32 that ``torch.save`` records for
each record of its zip archive.
"""
from __future__ import annotations

import collections
import enum
import errno
import json
import mmap
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch

from ..core.tree import iter_leaves
from .crc import crc32

PathLike = Union[str, "os.PathLike[str]"]

TMP_PREFIX = ".tmp-"  # an unfinished write; removed (or ignored) later
DEL_PREFIX = ".del-"  # a checkpoint being deleted by the retention policy


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the reason."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed (unwritable folder, full disk...); earlier checkpoints are untouched."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint file is missing, has another size or checksum than ``meta.json`` records, or cannot be parsed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested checkpoint (path, ``last`` or ``best`` pointer) does not exist."""


class UnsafeCheckpointError(CheckpointError):
    """A file holds objects other than tensors and plain values; it was refused and nothing in it ran."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value handed to a checkpoint is neither a tensor nor a plain Python value."""


# -- plain values ------------------------------------------------------------------------------
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)


def _convert_leaf(obj: Any) -> Any:
    """A storable replacement for a well-known non-plain leaf, or ``_NO``."""
    if isinstance(obj, enum.Enum):
        value = obj.value
        return value if isinstance(value, (str, int, float, bool)) else obj.name
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    module = type(obj).__module__
    if module == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype == np.uint32:  # torch has no full uint32 support: widen
                obj = obj.astype(np.int64)
            return torch.from_numpy(obj.copy())
        if isinstance(obj, np.generic):
            return obj.item()
    return _NO


_NO = object()


def _where(path: str) -> str:
    return path or "the value"


def to_plain(obj: Any, path: str = "") -> Any:
    """``obj`` with only tensors, plain Python values and ``dict``/``list``/``tuple``/``set`` left.

    Enums become their values, ``Config`` and other dict subclasses plain dicts (``OrderedDict``
    kept), named tuples plain tuples, NumPy arrays tensors and NumPy scalars numbers. Anything
    else raises ``UnsupportedValueError`` naming where it sits (``path``). Containers that need
    no change are returned as they are (so a model ``state_dict`` keeps its metadata).
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, enum.Enum):  # before _LEAVES: an IntEnum is an int, but pickles as its class
        return _convert_leaf(obj)
    if isinstance(obj, _LEAVES):
        if type(obj) in _LEAVES:
            return obj
        # a subclass of a plain type (e.g. a str subclass) pickles as its own class: use the base
        for base in _LEAVES:
            if isinstance(obj, base):
                return base(obj)
    if isinstance(obj, dict):
        items = []
        changed = type(obj) not in (dict, collections.OrderedDict)
        for k, v in obj.items():
            k2 = to_plain(k, f"{path} key {k!r}")
            v2 = to_plain(v, f"{path}[{k!r}]")
            changed = changed or k2 is not k or v2 is not v
            items.append((k2, v2))
        if not changed:
            return obj
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple, set, frozenset)):
        vals = [to_plain(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if type(obj) in (list, tuple, set) and all(a is b for a, b in zip(vals, obj)):
            return obj
        if isinstance(obj, (set, frozenset)):
            return set(vals)
        return vals if isinstance(obj, list) else tuple(vals)
    converted = _convert_leaf(obj)
    if converted is not _NO:
        return converted
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    hint = ("give it a state_dict() that returns tensors and plain values and store that"
            if not callable(obj) else "store a name or the value it computes instead of the callable")
    raise UnsupportedValueError(f"cannot store {_where(path)} in a checkpoint: a {kind} is not a tensor or a plain "
                                f"Python value (None, bool, int, float, str, bytes, list, tuple, dict); {hint}")


def to_jsonable(obj: Any, depth: int = 0) -> Any:
    """A JSON-friendly summary of ``obj`` (for metadata): unknown objects become their ``repr``."""
    if depth > 20:
        return "..."
    if isinstance(obj, enum.Enum):
        return _convert_leaf(obj)
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else f"tensor(shape={tuple(obj.shape)}, dtype={obj.dtype})"
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v, depth + 1) for v in obj]
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    converted = _convert_leaf(obj)
    if converted is not _NO and not isinstance(converted, torch.Tensor):
        return converted
    r = repr(obj)
    return r if len(r) <= 200 else r[:197] + "..."


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data inside ``obj`` (nested containers walked)."""
    return sum(t.numel() * t.element_size() for t in iter_leaves(obj) if isinstance(t, torch.Tensor))


# -- fsync helpers -------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """``8.1 KiB`` style sizes (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fsync_dir(path: PathLike) -> None:
    """Make a rename or a new entry in folder ``path`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _describe_os_error(e: OSError) -> str:
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or str(e)
    hints = {errno.ENOSPC: " (the disk is full)", errno.EDQUOT: " (disk quota exceeded)",
             errno.EFBIG: " (file size limit reached)", errno.EROFS: " (read-only file system)",
             errno.EACCES: " (no permission to write there)", errno.ENOTDIR: " (a file is in the way of the folder)"}
    hint = hints.get(e.errno, "")
    if hint[2:-1].lower() == text.lower():
        hint = ""  # the system's words already say it
    return f"{text}{hint}" + (f" [{code}]" if code else "")


CHECKSUM_KIND = "crc32"


def _checksum_text(crc: int) -> str:
    return f"{CHECKSUM_KIND}:{crc:08x}"


class _ChecksumWriter:
    """A binary file that keeps a CRC-32 of every byte written through it (``torch.save`` writes through it)."""

    def __init__(self, f):
        self._f = f
        self.crc = 0

    def write(self, data) -> int:
        self.crc = crc32(data, self.crc)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def write_file(path: PathLike, writer: Callable[[Any], None]) -> str:
    """Create ``path`` (a new name), let ``writer(f)`` fill it, flush and fsync; returns its checksum.

    The checksum (``'crc32:<8 hex digits>'``) is computed from the bytes as they are written, so a
    large file is not read back. Every failure to write surfaces as an ``OSError`` (``torch.save``
    reports a full disk as a ``RuntimeError`` raised while handling the ``OSError``: the ``OSError``
    is raised instead).
    """
    try:
        with open(path, "wb") as f:
            out = _ChecksumWriter(f)
            writer(out)
            f.flush()
            os.fsync(f.fileno())
            return _checksum_text(out.crc)
    except OSError:
        raise
    except RuntimeError as e:
        cause: Optional[BaseException] = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise OSError(f"torch.save failed: {e}") from e


def file_checksum(path: PathLike) -> str:
    """The checksum of the file ``path`` as ``write_file`` reports it, taken over a read-only memory map of it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return _checksum_text(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
            return _checksum_text(crc32(pages))


def verify_checksum(path: PathLike, expected: str) -> None:
    """Raise ``CheckpointDamagedError`` naming ``path`` when its checksum is not ``expected``."""
    kind = expected.split(":", 1)[0]
    if kind != CHECKSUM_KIND:
        return  # written by a later version with another checksum: its size was checked
    try:
        actual = file_checksum(path)
    except OSError as e:
        raise CheckpointDamagedError(f"could not read checkpoint file {path}: {_describe_os_error(e)}") from e
    if actual != expected:
        raise CheckpointDamagedError(f"checkpoint file {path} is damaged: its checksum is {actual}, and {expected} was "
                                     f"recorded when it was written")


def verify_records(path: PathLike) -> bool:
    """Compare every record of the ``torch.save`` file ``path`` with the CRC-32 its zip archive holds for it.

    Raises ``CheckpointDamagedError`` naming the file and the record that differs; returns False when
    the file carries no CRCs to compare (torch's pre-zip format, or written with
    ``torch.serialization.set_crc32_options(False)``), True when every record matches. ``torch.load``
    itself never compares them, so a flipped byte in a tensor would otherwise load silently. The records
    are read through a memory map of the file, so ``load_single_file`` then builds the tensors on the
    same pages without reading the file again.
    """
    path = Path(path)
    _require_torch_format(path)  # (a single file's first reader: a file given by mistake is named as such here)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return False
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
                if not zipfile.is_zipfile(pages):
                    return False  # not a zip archive: torch.load reports the damage it meets
                bad = _first_bad_record(pages)
    except OSError as e:
        raise CheckpointDamagedError(f"could not read checkpoint file {path}: {_describe_os_error(e)}") from e
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError, struct.error, zlib.error) as e:
        raise CheckpointDamagedError(f"checkpoint file {path} is damaged: its zip archive cannot be read "
                                     f"({type(e).__name__}: {e})") from e
    if bad is False:
        return False
    if bad is not None:
        raise CheckpointDamagedError(f"checkpoint file {path} is damaged: its record {bad} differs from the CRC-32 "
                                     f"recorded for it when it was written")
    return True


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip record's local header: signature, ..., name and extra lengths


def _first_bad_record(pages: mmap.mmap):
    """The name of the first record of the mapped zip archive whose CRC-32 differs, None when all match, False when
    it records no CRCs. ``torch.save`` stores its records uncompressed, so each CRC is taken over the mapped bytes
    themselves (nothing copied); a compressed record (another writer) is checked by ``zipfile`` reading it."""
    with zipfile.ZipFile(pages) as archive, memoryview(pages) as view:
        records = archive.infolist()
        if not any(r.CRC for r in records if r.file_size):
            return False
        for r in records:
            if r.compress_type != zipfile.ZIP_STORED:
                with archive.open(r) as member:  # zipfile compares the CRC-32 as it reads to the end
                    while member.read(1 << 20):
                        pass
                continue
            magic, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, r.header_offset)
            if magic != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"the local header of record {r.filename} is damaged")
            start = r.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if start + r.file_size > len(view) or crc32(view[start:start + r.file_size]) != r.CRC:
                return r.filename
    return None


def save_file(obj: Any, path: PathLike) -> str:
    """``torch.save`` of ``to_plain(obj)`` to a new file ``path``, fsynced; returns its checksum."""
    plain = to_plain(obj)
    return write_file(path, lambda f: torch.save(plain, f))


def atomic_save(obj: Any, path: PathLike) -> Path:
    """Write ``obj`` (tensors and plain values) to ``path`` atomically: temp file, fsync, ``os.replace``.

    On failure the temp file is removed, any earlier file at ``path`` is untouched and a
    ``CheckpointWriteError`` naming ``path`` is raised.
    """
    path = Path(path)
    plain = to_plain(obj)  # before touching the disk: a bad value fails cleanly
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
    try:
        write_file(tmp, lambda f: torch.save(plain, f))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise CheckpointWriteError(f"could not write checkpoint {path}: {_describe_os_error(e)}; "
                                   f"an earlier file at that path is untouched") from e
    return path


def atomic_write_text(path: PathLike, text: str) -> None:
    """Replace the small text file ``path`` atomically (temp file, fsync, ``os.replace``, fsync of the folder)."""
    path = Path(path)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
    try:
        write_file(tmp, lambda f: f.write(text.encode("utf-8")))
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_json(path: PathLike, data: Dict[str, Any]) -> str:
    return write_file(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=False).encode("utf-8")))


# -- reading -------------------------------------------------------------------------------------
def _unsupported_global(message: str) -> Optional[str]:
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message) or re.search(r"GLOBAL ([\w.]+)", message)
    if m:
        return m.group(1)
    m = re.search(r"Unsupported operand (\d+)", message)
    return f"pickle opcode {m.group(1)}" if m else None


def load_file(path: PathLike, checksum: Optional[str] = None) -> Any:
    """Read a checkpoint file with ``torch.load(weights_only=True, map_location="cpu")``.

    With ``checksum`` (as ``write_file`` returned it) the file is compared with it first, so damage
    anywhere, the pickle included, raises ``CheckpointDamagedError`` before anything is unpickled.
    The comparison reads the file through a memory map and the tensors are then built on the same
    mapped pages (``mmap=True``): the file is read once, and its tensors are copy-on-write views of
    it until they are changed. A file that needs anything but tensors and plain values raises
    ``UnsafeCheckpointError`` before anything in it runs; a missing file ``CheckpointNotFoundError``;
    a truncated or damaged one ``CheckpointDamagedError``. Every message names the file.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint file {path} does not exist")
    mapped = checksum is not None and checksum.split(":", 1)[0] == CHECKSUM_KIND
    if checksum is not None:
        verify_checksum(path, checksum)
    return torch_load(path, mapped and zipfile.is_zipfile(path))


def load_single_file(path: PathLike) -> Any:
    """``load_file`` of a single-file checkpoint, checked by ``verify_records`` (it has no ``meta.json`` to check
    against); the tensors are built on the pages that check read, as ``load_file`` does."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint file {path} does not exist")
    return torch_load(path, verify_records(path))


def _require_torch_format(path: Path) -> None:
    """``path`` starts as ``torch.save`` files do: a zip archive, or (torch's legacy format) a pickle. A file in
    neither (a metrics file, a note) would meet torch's own errors, which read as damage or danger."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return  # (the load names the error)
    if not head or head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return  # (an empty file is a truncated one: the load says so)
    raise CheckpointError(f"{path} is not a checkpoint file: it is not in torch's save format (it begins with "
                          f"{head!r}: a text file, such as a run's metrics.csv or metrics.jsonl?). Give a checkpoint "
                          f"folder, a 'last'/'best' pointer next to them, or a file save_checkpoint or ckpt merge "
                          f"wrote")


def torch_load(path: Path, mapped: bool) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU (``mapped``: on a memory map of the file), every
    failure named: ``UnsafeCheckpointError`` for a file that needs more than tensors and plain values (nothing in
    it runs), ``CheckpointDamagedError`` for one that cannot be parsed."""
    try:
        with warnings.catch_warnings():  # a refused file gets our message below, not torch's protocol notice
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as e:
        what = _unsupported_global(str(e))
        raise UnsafeCheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain Python values"
            f"{f' ({what})' if what else ''}, and loading them could run code from the file. "
            f"colossal_lite only writes tensors and plain values, so this file was written by something else or "
            f"was modified. Nothing in it was run. Load it with torch.load(..., weights_only=False) only if you "
            f"trust where it came from.") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointDamagedError(f"could not read checkpoint file {path}: it is truncated or damaged ({e})") from e
