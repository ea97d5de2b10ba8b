"""Where the bytes of a memory-mapped tensor live on disk, so they can be copied through the file.

Rank files are loaded with ``torch.load(mmap=True)``: their tensors are views of a mapping of the
file. Handing such a view to ``pwrite`` makes the kernel fault in and walk every source page;
copying the same bytes through the file descriptor (``copy_file_range`` into the output file,
``preadv`` into a buffer) skips that, and took 2-3x less system time on the benchmark checkpoint.

A reader registers the tensors it loaded from a file (:func:`register`: each storage's file offset,
found through the file's entries in ``/proc/self/maps``, Linux only) and drops them when it closes
(the reader keeps the tensors alive until then, so a registered address always holds that file's
bytes). :func:`locate` answers "which file and offset hold this tensor's bytes", or None, and callers
then use the pages as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by whoever hands tensors in; pread/pwrite need none
    import torch

MAPS = "/proc/self/maps"
PROBE_BYTES = 64
# copy_file_range errors that mean "not between these files / not here": copy through memory instead.
UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


@dataclass(frozen=True)
class _Storage:
    fd: int
    offset: int  # file offset of the storage's first byte
    nbytes: int
    # a registered tensor on this storage: while it lives, so does the mapping at this address. Once
    # it is gone the address may hold another file's mapping (a reader dropped without close(), its
    # pages unmapped, the address reused by the next torch.load(mmap=True)): never trusted then.
    owner: "weakref.ref[torch.Tensor]"


_lock = threading.Lock()
_storages: dict[int, _Storage] = {}  # storage data_ptr -> where its bytes are in the file
_registrations: dict[int, tuple[int, list[int]]] = {}  # token -> (fd, storage pointers)
_next_token = 0


def _mapped_ranges(path: Path) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of every mapping of ``path`` in this process."""
    st = os.stat(path)
    found = []
    try:
        with open(MAPS) as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or int(parts[4]) != st.st_ino:
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) != st.st_dev:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                found.append((lo, hi, int(parts[2], 16)))
    except OSError:
        return []
    return found


def _file_offset(ranges: list[tuple[int, int, int]], ptr: int, nbytes: int) -> int | None:
    for lo, hi, offset in ranges:
        if lo <= ptr and ptr + nbytes <= hi:
            return offset + (ptr - lo)
    return None


def register(path: Path, tensors) -> int | None:
    """Record where the storages of ``tensors`` (views of ``path``'s mapping, kept alive by the
    caller until :func:`unregister`) are in the file. Returns a token, or None when nothing could
    be located (not Linux, not memory-mapped)."""
    global _next_token
    try:
        ranges = _mapped_ranges(Path(path))
    except OSError:
        return None
    if not ranges:
        return None
    fd = os.open(path, os.O_RDONLY)
    found: dict[int, _Storage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or ptr in found or t.device.type != "cpu":
            continue
        offset = _file_offset(ranges, ptr, nbytes)
        if offset is None:
            continue
        n = min(PROBE_BYTES, nbytes)
        if os.pread(fd, n, offset) != bytes((ctypes.c_char * n).from_address(ptr)):
            continue  # not this file's bytes after all: never trusted
        found[ptr] = _Storage(fd, offset, nbytes, weakref.ref(t))
    if not found:
        os.close(fd)
        return None
    with _lock:
        _next_token += 1
        token = _next_token
        _registrations[token] = (fd, list(found))
        _storages.update(found)
    return token


def unregister(token: int | None) -> None:
    with _lock:
        fd, pointers = _registrations.pop(token, (None, []))
        for ptr in pointers:
            if ptr in _storages and _storages[ptr].fd == fd:
                del _storages[ptr]
    if fd is not None:
        os.close(fd)


def register_within(token: int, parent: torch.Tensor, tensors) -> int:
    """Add to registration ``token`` tensors whose storages lie inside ``parent``'s registered
    storage (e.g. ``torch.frombuffer`` views, at any byte offset, of the mapping ``parent`` covers):
    their file offsets follow from the parent's, with no ``/proc/self/maps`` walk and no extra file
    descriptor. The caller keeps ``parent``'s mapping alive while they live. Returns how many were
    added (none when the parent is not registered under ``token``)."""
    base = parent.untyped_storage().data_ptr()
    with _lock:
        entry = _storages.get(base)
        fd, pointers = _registrations.get(token, (None, None))
        if entry is None or entry.fd != fd or entry.owner() is None or pointers is None:
            return 0
        added = 0
        for t in tensors:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or t.device.type != "cpu" or ptr < base or ptr + nbytes > base + entry.nbytes:
                continue
            held = _storages.get(ptr)
            if held is not None and held.owner() is not None:
                continue
            _storages[ptr] = _Storage(fd, entry.offset + (ptr - base), nbytes, weakref.ref(t))
            pointers.append(ptr)
            added += 1
    return added


def registered() -> bool:
    """Whether any file-backed storage is registered (else :func:`locate` finds nothing)."""
    return bool(_storages)


def locate(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(fd, offset)`` of the file bytes of a contiguous tensor whose storage was registered."""
    if not _storages or tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    storage = tensor.untyped_storage()
    with _lock:
        entry = _storages.get(storage.data_ptr())
    if entry is None or entry.owner() is None:
        return None
    start = tensor.data_ptr() - storage.data_ptr()
    if start < 0 or start + tensor.numel() * tensor.element_size() > entry.nbytes:
        return None
    return entry.fd, entry.offset + start


def storage_span(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """``(fd, offset, nbytes)`` of the registered file bytes of ``tensor``'s whole storage."""
    if not _storages or tensor.device.type != "cpu":
        return None
    with _lock:
        entry = _storages.get(tensor.untyped_storage().data_ptr())
    if entry is None or entry.owner() is None:
        return None
    return entry.fd, entry.offset, entry.nbytes


def copy_to_file(tensor: torch.Tensor, out_fd: int, out_offset: int) -> bool:
    """Copy ``tensor``'s bytes from its file to ``out_fd`` at ``out_offset`` with
    ``copy_file_range``; False (nothing assumed written) when the tensor is not file-backed or the
    kernel cannot copy between these files."""
    src = locate(tensor)
    if src is None:
        return False
    fd, offset = src
    total = tensor.numel() * tensor.element_size()
    done = 0
    try:
        while done < total:
            n = os.copy_file_range(fd, out_fd, total - done, offset + done, out_offset + done)
            if n <= 0:
                return False
            done += n
    except OSError as e:
        if e.errno in UNSUPPORTED:
            return False
        raise
    return True


def read_into(tensor: torch.Tensor, out: torch.Tensor) -> bool:
    """Fill the contiguous CPU tensor ``out`` (same dtype and size) from ``tensor``'s file with
    ``preadv``; False when ``tensor`` is not file-backed (``out`` untouched then)."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != tensor.dtype or out.numel() != tensor.numel():
        return False
    src = locate(tensor)
    if src is None:
        return False
    import torch

    fd, offset = src
    pread_exact(fd, memoryview(out.reshape(-1).view(torch.uint8).numpy()), offset)
    return True


def pread_exact(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` with the bytes of ``fd`` from ``offset`` (``preadv``, partial reads continued)."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


def pwrite_exact(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``pwrite``, partial writes continued)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
