"""Write-then-rename helpers: a reader never sees a half-written file or directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fp8rl.errors import UserError


class OutputExistsError(UserError, FileExistsError):
    """The destination exists and overwriting was not asked for."""


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``dst``; rename it to ``dst`` on success.

    On any exception the temporary directory is removed and ``dst`` is untouched.
    With ``overwrite`` an existing ``dst`` is replaced only after the new one is
    complete.
    """
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise OutputExistsError(f"{dst} already exists (pass --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
            os.replace(tmp, dst)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename."""
    atomic_write_bytes(path, text.encode())
