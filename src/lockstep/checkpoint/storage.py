"""Durable file operations: atomic writes (temp file, fsync, rename, fsync dir), checksums, clear I/O errors.

A reader never sees a half-written file under its final name: bytes go to a temp file that is fsynced
and then renamed, and the directory is fsynced so that the rename itself survives a power cut. A whole
checkpoint is published the same way, by renaming its finished temp directory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """What meta.json says about a file: its size and sha256."""

    num_bytes: int
    sha256: str

    def to_json(self) -> dict[str, int | str]:
        return {"bytes": self.num_bytes, "sha256": self.sha256}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> FileRecord:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`, never a mix."""
    temp = path.with_name(f".{path.name}.partial")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        remove_quietly(temp)
        raise
    fsync_dir(path.parent)
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def publish_dir(temp: Path, final: Path, old: Path) -> None:
    """Rename the finished directory `temp` to `final`; an existing `final` is moved to `old`, then removed."""
    fsync_dir(temp)
    replaced = final.exists()
    if replaced:
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(final.parent)
    if replaced:
        shutil.rmtree(old, ignore_errors=True)


def remove_quietly(path: Path) -> None:
    """Best-effort cleanup after a failure: the original error is the one worth reporting."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def explain_os_error(exc: OSError) -> str:
    """A hint for the I/O errors a checkpoint meets in practice."""
    code = exc.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return "no space left on the device (or quota exceeded): free space, lower `keep`, or use another run_dir"
    if code == errno.EROFS:
        return "the file system is read-only: use a writable run_dir"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied: use a run_dir this user can write"
    if code == errno.ENOENT:
        return "a directory on the path does not exist (removed while the run was going?)"
    if code == errno.ENOTDIR:
        return "a part of the path is a file, not a directory"
    return "an I/O error"
