"""Atomic outputs: write beside the target, then rename, so no reader (a later
DVC stage, the service) ever sees half a file or half a model directory.

The temporary files and directories are created the way a plain `open`/`mkdir`
would create them, so outputs get the ordinary modes the umask gives (0644 and
0755 under umask 022), not `tempfile`'s private 0600/0700: a container user or
another host user must be able to read an exported model.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from lmops.errors import LmopsError

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _sibling(path: Path) -> Path:
    """A fresh hidden name beside `path` (creation with O_EXCL/mkdir catches the unlikely clash)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def disk_full_names(path: str | Path) -> Iterator[None]:
    """A full disk (or quota, or file size limit) while writing `path` becomes one line naming it."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _FULL:
            raise LmopsError(f"{path}: {os.strerror(exc.errno).lower()} while writing it") from None
        raise


def remove_stale(path: str | Path) -> None:
    """Remove what writers of `path` killed midway left beside it (their hidden temporaries)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


class Output:
    """A file being written whose `write` names its target when the disk fills."""

    def __init__(self, fh: BinaryIO, path: Path):
        self._fh, self.path = fh, path

    def write(self, data: bytes) -> None:
        with disk_full_names(self.path):
            self._fh.write(data)


@contextlib.contextmanager
def writer(path: str | Path) -> Iterator[Output]:
    """A binary file to write in pieces (a stream too large to hold): it replaces `path` when
    the block ends without error, and is removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as fh:
            yield Output(fh, path)
            with disk_full_names(path):
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    with writer(path) as fh:
        fh.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def directory(path: str | Path) -> Iterator[Path]:
    """Yield a new sibling directory to fill; on success it replaces `path` whole.

    A reader sees the old version or the new one, never a mix. The old version is
    renamed aside, then the new one into place: for the instant between the two
    renames `path` does not exist, so a reader that finds it missing should retry.
    A process killed right there leaves it missing (the old version sits in
    `.<name>.old` until the next write); `lmops promote` re-exports the champion
    when it finds no export.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path)
    tmp.mkdir()  # mode 0o777 minus the umask, as for any mkdir
    try:
        with disk_full_names(path):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
