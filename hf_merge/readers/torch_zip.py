"""The record structure of ``torch.save`` zip archives, checked before anything trusts it.

torch's zip reader (miniz) finds a record's data through the *local* header in front of it, while
sizes come from the *central* directory; a flipped byte in a local header silently moves the data
window. ``torch.save`` writes a rigid layout, and this module checks all of it, for whole files
(FSDP rank files, legacy Megatron ``model.pt``) and for archives embedded in a DCP ``.distcp``:

- every record is stored (compression method 0; torch never compresses, and a deflated record
  could inflate to gigabytes), not encrypted, and its local header repeats the central
  directory's name, flags and method;
- records tile the archive: the first starts at byte 0, each next local header starts exactly
  where the previous record (data + data descriptor) ends, and the last ends at the central
  directory; so the data start derived from the local header cannot drift;
- torch writes data descriptors (flag bit 3): the descriptor after each record repeats the
  central directory's CRC-32 and sizes (without descriptor: the local header's fields must).

:func:`crc_mismatches` re-reads the records and compares their CRC-32 with the directory's (what
``hf-merge verify --against`` does for every source file).
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import IO, Any

from ..errors import CorruptCheckpointError


def combine_crc32(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's
    ``crc32_combine``, which Python's ``zlib`` does not export; ISA-L's where it is installed):
    ``crc1`` times x^(8 * length2) modulo the (reflected) polynomial, plus ``crc2``."""
    return _multiply(_x_power(8 * length2), crc1) ^ crc2


_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed: bit 31 is x^0


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial, both in the reflected bit order."""
    product, bit = 0, 1 << 31
    while bit:
        if a & bit:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        bit >>= 1
    return product


def _x_power(n: int) -> int:
    """x^n modulo the polynomial (reflected), by squaring."""
    result, square = 1 << 31, 1 << 30  # x^0, x^1
    while n:
        if n & 1:
            result = _multiply(square, result)
        square = _multiply(square, square)
        n >>= 1
    return result


try:  # ISA-L's CRC-32 (carry-less multiply): ~24 GB/s here against zlib 1.2.13's ~1.4-1.9 GB/s
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # no wheel for this platform: zlib's, the same values
    from zlib import crc32

    crc32_combine = combine_crc32


_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader (30 bytes)
_DD32 = struct.Struct("<4sLLL")  # data descriptor with signature, 32-bit sizes
_DD64 = struct.Struct("<4sLQQ")  # zip64 data descriptor
MAX_RECORDS = 1 << 20


@dataclass(frozen=True)
class Record:
    """One stored record: its data is ``[data_start, data_start + size)`` of the file."""

    name: str
    data_start: int
    size: int
    crc: int


class Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of an open file descriptor.

    ``ends``: its first and last ``ends`` bytes are read once, up front (two ``pread`` calls), and the
    reads that fall inside them are served from memory: a ``torch.save`` archive embedded in a DCP
    file keeps its small records before its tensor's data and its central directory after it, so
    checking one costs two system calls instead of ~27. A read the prefetch does not cover (or
    only partly, e.g. past the end of a truncated file) goes to the file, as without ``ends``.
    """

    def __init__(self, fd: int, start: int, length: int, *, ends: int = 0):
        self._fd, self._start, self._length, self._pos = fd, start, length, 0
        self._head = os.pread(fd, min(ends, length), start) if ends > 0 else b""
        self._tail_at = max(len(self._head), length - ends)
        self._tail = os.pread(fd, length - self._tail_at, start + self._tail_at) if ends > 0 and length > self._tail_at else b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` of the window (fewer at its end or the file's)."""
        n = max(0, min(n, self._length - offset))
        end = offset + n
        if end <= len(self._head):
            return self._head[offset:end]
        if offset >= self._tail_at and end - self._tail_at <= len(self._tail):
            return self._tail[offset - self._tail_at : end - self._tail_at]
        return os.pread(self._fd, n, self._start + offset) if n else b""

    def readinto(self, b: Any) -> int:
        data = self.pread(len(b), self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _pread(f: IO[bytes], n: int, offset: int) -> bytes:
    if isinstance(f, Window):
        return f.pread(n, offset)
    f.seek(offset)
    return f.read(n)


def read_records(f: IO[bytes], where: str, *, base: int = 0) -> dict[str, Record]:
    """Check the archive in ``f`` and return its records by name (offsets absolute: ``+ base``).

    ``f`` is a seekable binary file whose position 0 is the archive's first byte (a
    :class:`Window` for an embedded archive); ``base`` is added to the returned data offsets.

    Raises:
        CorruptCheckpointError: not a zip, or any of the checks in the module docstring fails.
    """
    try:
        zf = zipfile.ZipFile(f)
        infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
        start_dir = zf.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, ValueError, EOFError, struct.error) as e:
        raise CorruptCheckpointError(
            f"{where}: not a torch.save archive or truncated ({_first(e)}); re-copy it from the training run"
        ) from None
    if len(infos) > MAX_RECORDS:
        raise CorruptCheckpointError(f"{where}: {len(infos)} zip records; not a torch.save archive")
    out: dict[str, Record] = {}
    pos = 0
    for info in infos:
        name = info.filename
        bad = _check_record(f, info, pos, where)
        if isinstance(bad, str):
            raise CorruptCheckpointError(
                f"{where}: zip record {name[:60]!r} {bad}; the file is damaged, re-copy it from the training run"
            )
        data_start, pos = bad
        if name in out:
            raise CorruptCheckpointError(f"{where}: zip record {name[:60]!r} appears twice; the file is damaged")
        out[name] = Record(name, base + data_start, info.file_size, info.CRC)
    if pos != start_dir:
        raise CorruptCheckpointError(
            f"{where}: zip records end at byte {pos} but the central directory starts at {start_dir}; "
            "the file is damaged, re-copy it from the training run"
        )
    return out


def read_data_pickle(f: IO[bytes], where: str) -> tuple[dict[str, Record], str, bytes]:
    """A ``torch.save`` zip's checked records, its archive prefix (``"archive/"``) and the bytes of
    its one ``data.pkl``."""
    records = read_records(f, where)
    pkl = [n for n in records if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise CorruptCheckpointError(f"{where}: not a torch.save file (no single data.pkl record); re-copy it")
    rec = records[pkl[0]]
    return records, pkl[0][: -len("data.pkl")], checked_pickle(_pread(f, rec.size, rec.data_start), rec, where)


def checked_pickle(data: bytes, rec: Record, where: str) -> bytes:
    """``data``, the bytes of the ``data.pkl`` record ``rec``, once their CRC-32 is the one the zip
    directory records. Always checked (a few microseconds; ``--no-source-crc`` is for the tensor
    bytes): the pickle says where every tensor is, and a flipped byte in it would otherwise read as
    a refused global, with advice for an unsafe file instead of a damaged one."""
    got = crc32(data)
    if got != rec.crc:
        raise CorruptCheckpointError(
            f"{where}: zip record {rec.name[:60]!r} fails its CRC-32 (the zip directory says {rec.crc:08x}, "
            f"its {len(data)} bytes give {got:08x}); the file is damaged: re-copy it from the training run"
        )
    return data


def _check_record(f: IO[bytes], info: zipfile.ZipInfo, expected_at: int, where: str) -> "str | tuple[int, int]":
    """Check one record; return ``(data_start, end)`` or what is wrong with it."""
    if info.compress_type != zipfile.ZIP_STORED:
        return f"is compressed (method {info.compress_type}); torch.save never compresses records"
    if info.flag_bits & 0x1:
        return "is encrypted"
    if info.header_offset != expected_at:
        return f"starts at byte {info.header_offset}, the previous record ends at {expected_at}"
    if info.compress_size != info.file_size:
        return "has a stored size different from its size"
    hdr = _pread(f, _LOCAL.size, info.header_offset)
    if len(hdr) != _LOCAL.size:
        return "has a truncated local header"
    sig, _v, _os, flags, method, _t, _d, crc, csize, usize, nlen, elen = _LOCAL.unpack(hdr)
    if sig != b"PK\x03\x04":
        return "has no local header signature"
    raw_name = _pread(f, nlen, info.header_offset + _LOCAL.size)
    encoding = "utf-8" if flags & 0x800 else "cp437"
    try:
        local_name = raw_name.decode(encoding)
    except UnicodeDecodeError:
        return "has an undecodable local name"
    if local_name != info.orig_filename or flags != info.flag_bits or method != info.compress_type:
        return "has a local header that disagrees with the central directory (name, flags or method)"
    data_start = info.header_offset + _LOCAL.size + nlen + elen
    end = data_start + info.file_size
    if flags & 0x8:
        if crc not in (0, info.CRC) or (csize, usize) not in ((0, 0), (info.compress_size, info.file_size)) and not (
            csize == usize == 0xFFFFFFFF
        ):
            return "has local sizes or CRC that disagree with the central directory"
        raw = _pread(f, _DD64.size, end)
        for st in (_DD32, _DD64):
            if len(raw) >= st.size:
                dsig, dcrc, dc, du = st.unpack(raw[: st.size])
                if dsig == b"PK\x07\x08" and (dcrc, dc, du) == (info.CRC, info.compress_size, info.file_size):
                    return data_start, end + st.size
        return "has no data descriptor matching the central directory where its data ends"
    if crc != info.CRC or (csize, usize) != (info.compress_size, info.file_size):
        if not (csize == usize == 0xFFFFFFFF):  # zip64: sizes in the extra field, checked by tiling
            return "has local sizes or CRC that disagree with the central directory"
    return data_start, end


def crc_mismatches(f: IO[bytes], records: dict[str, Record], chunk: int = 16 << 20) -> list[str]:
    """Names of records whose data does not have the CRC-32 the zip directory records."""
    bad = []
    for rec in records.values():
        crc, done = 0, 0
        f.seek(rec.data_start)
        while done < rec.size:
            data = f.read(min(chunk, rec.size - done))
            if not data:
                break
            crc = crc32(data, crc)
            done += len(data)
        if done != rec.size or crc != rec.crc:
            bad.append(rec.name)
    return bad


def archive_crc_mismatches(archives: "list[tuple[Any, int, int | None]]") -> tuple[int, list[str]]:
    """Check the CRC-32 of every record of ``(file, start, length)`` archives (``length`` None:
    the whole file). Returns ``(records checked, ["file: record" that differ])``."""
    checked, bad = 0, []
    for path, start, length in archives:
        with open(path, "rb") as f:
            size = length if length is not None else os.fstat(f.fileno()).st_size - start
            window = Window(f.fileno(), start, size) if (start or length is not None) else f
            where = f"{os.path.basename(path)}" + (f" (archive at byte {start})" if start else "")
            try:
                records = read_records(window, where, base=start)
            except CorruptCheckpointError as e:
                bad.append(str(e))
                continue
            checked += len(records)
            bad += [f"{where}: record {name} fails its CRC-32" for name in crc_mismatches(f, records)]
    return checked, bad


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:120] if text else type(e).__name__)
