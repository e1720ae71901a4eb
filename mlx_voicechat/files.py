"""File-system helpers shared by every writer (bottom layer: imports nothing of this package)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Type


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (``os.umask`` sets it
    for every thread while it is read)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def read_json(path, error: Type[Exception], name: Optional[str] = None) -> Any:
    """The JSON value in ``path``; an unreadable file or bad JSON is one ``error`` naming the
    file as ``name`` (default: the path) and saying which of the two it was."""
    name = str(path) if name is None else name
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
    except ValueError as e:
        raise error(f"{name} is not valid JSON: {e}") from None


def write_file(target: Path, data: bytes, error: Type[Exception], name) -> None:
    """Write ``data`` to ``target`` without destroying anything: a regular file is written as a
    temporary file beside it, then renamed over it, keeping a replaced file's permissions and
    (where allowed) owner; a character device or FIFO is written through. An ``OSError`` is one
    ``error`` naming the file as ``name``."""
    tmp = None
    try:
        try:
            st: Optional[os.stat_result] = os.stat(target)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(target, "wb") as f:
                f.write(data)
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if st is None:
            os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes the file private
        else:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                with contextlib.suppress(OSError):  # not permitted: ours, with its old mode
                    os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, target)
    except OSError as e:
        raise error(f"cannot write {name}: {e.strerror or e}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_folder(target: Path, replace: bool = False) -> Iterator[Path]:
    """A temporary folder beside ``target``, renamed onto it when the block ends: an interrupted
    write leaves nothing at ``target``. ``replace``: an existing ``target`` is moved aside first
    and removed only once the new folder is in place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would follow through the rename
        yield tmp
        if not replace:
            tmp.rename(target)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        old.rmdir()
        target.rename(old)
        try:
            tmp.rename(target)
        except BaseException:
            old.rename(target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
