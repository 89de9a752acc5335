"""Crash-safe file writes (a file is either its old self or wholly the new one, never torn) and
reads of JSON files that fail as one line naming the file."""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (temporary file, fsync, rename, fsync of the directory).
    On failure the temporary file is removed and `path` is untouched."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_json(path: str | os.PathLike, fix: str = "", what: str = "") -> object:
    """The JSON document in `path`; anything unreadable (missing, not UTF-8, not JSON, nested too
    deeply to parse) is a one-line `ColibriError` naming the file, what it is and `fix`."""
    from .errors import ColibriError

    path = Path(path)
    fix = f": {fix}" if fix else ""
    what = f" ({what})" if what else ""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ColibriError(f"{path}{what} is missing{fix}") from None
    except OSError as e:
        raise ColibriError(f"cannot read {path}{what}: {e.strerror or e}{fix}") from None
    except UnicodeDecodeError:
        raise ColibriError(f"{path}{what} is not UTF-8 text (damaged?){fix}") from None
    except json.JSONDecodeError as e:
        raise ColibriError(f"{path}{what} is not valid JSON ({e.msg} at line {e.lineno}){fix}") from None
    except (RecursionError, ValueError) as e:  # nested deeper than the parser goes; numbers it cannot hold
        why = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:120]
        raise ColibriError(f"{path}{what} is not usable JSON ({why}){fix}") from None


def remove_stale_temporaries(path: Path) -> None:
    """Remove ``NAME.PID.tmp`` files `write_atomic` left beside `path` in processes that were killed
    (their PID no longer runs); a live writer's temporary is left alone."""
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 1: -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a directory we may not write: leave it
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
