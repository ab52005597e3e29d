"""The CRC-32 of a whole file from the pieces a reader took from it, in whatever order it took them.

A reader such as ``torch.distributed.checkpoint`` seeks around a file (a zip archive's directory at
its end first, then each record); ``ReadChecksum`` takes the CRC-32 of each piece as it passes,
reads only the bytes nobody read, and joins the pieces with ``crc32_combine``. The file is therefore read from
the disk once, and its checksum equals the one ``io.write_file`` recorded for it.
"""
from __future__ import annotations

import bisect
import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, List, Tuple

# zlib-ng gives zlib's values with the CPU's carry-less multiply (checking a load costs far less than with zlib),
# and exposes zlib's ``crc32_combine``, which Python's own ``zlib`` does not.
from zlib_ng.zlib_ng import crc32, crc32_combine

__all__ = ["ReadChecksum", "ChecksummingFile", "crc32", "crc32_combine"]


class ReadChecksum:
    """The pieces of one file read so far, each with its CRC-32, none overlapping (bytes read twice count once)."""

    def __init__(self, size: int):
        self.size = size
        self._starts: List[int] = []
        self._pieces: List[Tuple[int, int, int]] = []  # (start, end, crc), sorted by start

    def note(self, offset: int, data) -> None:
        """``data`` (a bytes-like object) was read from ``offset``."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        i = bisect.bisect_right(self._starts, offset) - 1  # the last piece that starts at or before ``offset``
        at = max(offset, self._pieces[i][1]) if i >= 0 else offset
        i += 1
        while at < end:
            stop = min(end, self._pieces[i][0]) if i < len(self._pieces) else end
            if stop > at and i > 0 and self._pieces[i - 1][1] == at:  # goes on from a piece: extend its CRC-32
                start, _, crc = self._pieces[i - 1]
                self._pieces[i - 1] = (start, stop, crc32(view[at - offset:stop - offset], crc))
            elif stop > at:
                self._insert(i, (at, stop, crc32(view[at - offset:stop - offset])))
                i += 1
            if stop < end:  # the piece at ``i`` begins at ``stop``: its bytes were read before
                at = self._pieces[i][1]
                i += 1
            else:
                at = end

    def _insert(self, i: int, piece: Tuple[int, int, int]) -> None:
        self._starts.insert(i, piece[0])
        self._pieces.insert(i, piece)

    @property
    def pieces(self) -> List[Tuple[int, int, int]]:
        """``(start, end, crc)`` of every piece read, in order."""
        return list(self._pieces)

    def add(self, pieces: List[Tuple[int, int, int]]) -> None:
        """Pieces another reader of the file took (``pieces`` of its ``ReadChecksum``); one that overlaps a piece
        already here is left out, and ``finish`` reads what it alone covered."""
        for start, end, crc in pieces:
            if self.is_free(start, end):
                self._insert(bisect.bisect_right(self._starts, start), (start, end, crc))

    def is_free(self, start: int, end: int) -> bool:
        """No piece read so far overlaps ``[start, end)``."""
        i = bisect.bisect_right(self._starts, start)
        return (i == 0 or self._pieces[i - 1][1] <= start) and (i == len(self._pieces) or end <= self._pieces[i][0])

    def unread(self) -> int:
        """Bytes of the file no piece covers."""
        return self.size - sum(end - start for start, end, _ in self._pieces)

    def finish(self, f: BinaryIO) -> int:
        """The CRC-32 of the whole file ``f``: the pieces read, and what nobody read, read now."""
        crc, at = 0, 0
        for start, end, piece_crc in self._pieces + [(self.size, self.size, 0)]:
            if start > at:
                crc = _read_crc(f, at, start, crc)
            if end > start:
                crc = crc32_combine(crc, piece_crc, end - start)
            at = max(at, end)
        return crc


def _read_crc(f: BinaryIO, start: int, end: int, crc: int) -> int:
    f.seek(start)
    while start < end:
        chunk = f.read(min(end - start, 1 << 22))
        if not chunk:
            raise EOFError(f"the file ended at byte {start}, before byte {end}")
        crc = crc32(chunk, crc)
        start += len(chunk)
    return crc


_CHUNK = 1 << 22  # bytes: a large read is checksummed in chunks of this size, beside the reading of the next one
_POOL: List[ThreadPoolExecutor] = []


def _workers() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc"))
    return _POOL[0]


class ChecksummingFile(io.RawIOBase):
    """A read-only binary file that notes every byte read through it in a ``ReadChecksum``."""

    def __init__(self, f: BinaryIO, checksum: ReadChecksum):
        super().__init__()
        self._f, self.checksum = f, checksum

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b) -> int:
        at = self._f.tell()
        view = memoryview(b).cast("B")
        if len(view) >= 2 * _CHUNK and self.checksum.is_free(at, at + len(view)):
            return self._read_beside_checksum(at, view)
        n = self._f.readinto(view)
        if n:
            self.checksum.note(at, view[:n])
        return n

    def _read_beside_checksum(self, at: int, view: memoryview) -> int:
        """Read ``view`` chunk by chunk while a worker thread takes the CRC-32 of the chunks already read (zlib
        lets go of the GIL), so reading and checksumming overlap. Every chunk is checksummed before this returns:
        the buffer may be freed by the caller right after."""
        crc = [0]

        def take(chunk) -> None:  # the one worker runs these in order
            crc[0] = crc32(chunk, crc[0])

        pending, n = [], 0
        try:
            while n < len(view):
                got = self._f.readinto(view[n:n + _CHUNK])
                if not got:
                    break
                pending.append(_workers().submit(take, view[n:n + got]))
                n += got
        finally:
            for job in pending:
                job.result()
        if n:
            self.checksum.add([(at, at + n, crc[0])])
        return n

    def read(self, size: int = -1) -> bytes:
        at = self._f.tell()
        data = self._f.read(size)
        self.checksum.note(at, data)
        return data
