"""Reading ``sharded/`` with torch.distributed.checkpoint, every byte checked against ``meta.json`` as it is read.

DCP opens the files itself and seeks around in them; the file system given to its reader here hands
it files that take the CRC-32 of every piece read (``crc.py``). The ranks then share what they read,
and the rank that read the most of a file joins every rank's pieces into the file's checksum,
reading only the bytes no rank needed (shards nobody loads): each byte is read once. ``.metadata`` is plain ``pickle``:
it is read whole and compared before DCP unpickles it.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .crc import ChecksummingFile, ReadChecksum, crc32
from .io import CHECKSUM_KIND, CheckpointDamagedError, _checksum_text, _describe_os_error


class _CheckingFileSystem:
    """DCP's local file system (``plain``, which does all but reading), whose read streams note what is read
    (``files``); ``sums``: ``{file name: checksum}`` of the files in this folder, as ``meta.json`` records them (a
    file without one is read as it is)."""

    def __init__(self, plain, sums: Dict[str, str]):
        self._plain = plain
        self.sums = {name: value for name, value in sums.items() if value.split(":", 1)[0] == CHECKSUM_KIND}
        self.files: Dict[str, ReadChecksum] = {}
        self.damaged: Optional[CheckpointDamagedError] = None  # the first damage met (DCP rewraps what it raises)

    def __getattr__(self, name: str):
        return getattr(self._plain, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        expected = self.sums.get(path.name)
        if mode != "rb" or expected is None:
            with self._plain.create_stream(path, mode) as stream:
                yield stream
            return
        if path.suffix != ".distcp":  # DCP's .metadata: unpickled, so compared before it is
            data = self._read_whole(path)
            self._compare(path, crc32(data), expected)
            yield io.BytesIO(data)
            return
        with open(path, "rb") as f:
            read = self.files.setdefault(path.name, ReadChecksum(os.fstat(f.fileno()).st_size))
            yield ChecksummingFile(f, read)

    def _read_whole(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            self._damage(CheckpointDamagedError(f"could not read checkpoint file {path}: {_describe_os_error(e)}"))
            raise self.damaged from e

    def _compare(self, path: Path, crc: int, expected: str) -> None:
        actual = _checksum_text(crc)
        if actual != expected:
            self._damage(CheckpointDamagedError(f"checkpoint file {path} is damaged: its checksum is {actual}, and "
                                                f"{expected} was recorded when it was written"))
            raise self.damaged

    def _damage(self, error: CheckpointDamagedError) -> None:
        if self.damaged is None:
            self.damaged = error

    def pieces_read(self) -> Dict[str, Tuple[int, List[Tuple[int, int, int]]]]:
        """``{file: (size, pieces)}`` of every ``.distcp`` file this rank read (``ReadChecksum.pieces``)."""
        return {name: (read.size, read.pieces) for name, read in self.files.items()}

    def verify(self, folder: Path, every_rank: List[Dict[str, Tuple[int, List[Tuple[int, int, int]]]]],
               rank: int) -> None:
        """Compare each ``.distcp`` file that some rank read with its checksum, on the rank that read the most of it:
        the pieces every rank read are joined, and only the bytes no rank read are read now."""
        for name in sorted({name for read in every_rank for name in read}):
            readers = [(sum(e - s for s, e, _ in read[name][1]), -r) for r, read in enumerate(every_rank)
                       if name in read]
            if -max(readers)[1] != rank:
                continue
            joined = ReadChecksum(every_rank[rank][name][0])
            for read in [every_rank[rank]] + [read for r, read in enumerate(every_rank) if r != rank]:
                joined.add(read.get(name, (0, []))[1])
            self._verify_file(folder / name, joined)

    def _verify_file(self, path: Path, joined: ReadChecksum) -> None:
        try:
            with open(path, "rb") as f:
                crc = joined.finish(f)
        except (OSError, EOFError) as e:
            why = _describe_os_error(e) if isinstance(e, OSError) else str(e)
            self._damage(CheckpointDamagedError(f"could not read checkpoint file {path}: {why}"))
            raise self.damaged from e
        self._compare(path, crc, self.sums[path.name])


def checking_reader(folder: Path, sums: Dict[str, str]):
    """A ``FileSystemReader`` of ``folder`` (a checkpoint's ``sharded/``) whose reads are checked against ``sums``
    (``{file name in folder: checksum}``); after ``dcp.load``, ``reader.fs.verify`` completes the check from what
    every rank read (``reader.fs.pieces_read()`` of each)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    reader = FileSystemReader(str(folder))
    reader.fs = _CheckingFileSystem(reader.fs, sums)
    return reader
