"""Crash-safe file writes (a file is either its old self or wholly the new one, never torn), and
bounded reads: every file the engine reads whole is read through `read_bounded`, which refuses one
larger than its bound in one line naming the file and the bound (a regular file before reading it,
a pipe or device past the bound), so a damaged or mistaken file can never fill memory."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import ColibriError
from .sizes import format_bytes

# The bounds on what is read whole, each far above any real file of its kind: a file beyond its
# bound is damage or a mistake (a dump, a device, a sparse file), never a model.
MANIFEST_BYTES = 64 << 20  # colibri.yaml: under 1 MB for the largest models (a crc32 per expert)
CONFIG_BYTES = 16 << 20  # config.json, generation_config.json and other small JSON: a few KB each
TOKENIZER_BYTES = 256 << 20  # tokenizer.json, tokenizer_config.json: ~35 MB for 262k-token vocabularies
TEMPLATE_BYTES = 4 << 20  # chat_template.jinja: ~20 KB for the longest templates with tools
GRAMMAR_BYTES = 16 << 20  # a JSON schema or grammar given by path: as large as a server request may be
SESSION_HEADER_BYTES = 1 << 20  # a session file's identity JSON: a few hundred bytes


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


def read_bounded(path: str | os.PathLike, limit: int, what: str = "", fix: str = "") -> bytes:
    """The bytes of `path`, at most `limit` of them. Larger (a regular file by its size, before a
    byte is read; a pipe or a device such as /dev/zero by the `limit` + 1 bytes it gives), a
    directory, missing or unreadable: a one-line `ColibriError` naming the file, what it is, the
    bound where that is the reason, and `fix`. A pipe (`--config /dev/stdin`, a shell's `<(…)`) is
    read as it comes; a FIFO nobody writes reads as empty instead of waiting for a writer."""
    path = Path(path)
    what, fix = _said(what, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO with no writer: no wait to open
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ColibriError(f"{path}{what} is a directory, not a file{fix}")
            os.set_blocking(fd, True)  # a pipe's writer may be slower than this reader
            with open(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1) if st.st_size <= limit else b""
        finally:
            os.close(fd)
    except OSError as e:
        raise ColibriError(f"cannot read {path}{what}: {e.strerror or e}{fix}") from None
    if st.st_size > limit:
        raise ColibriError(f"{path}{what} is {format_bytes(st.st_size)}, more than the {format_bytes(limit)} "
                           f"such a file may be{fix}")
    if len(data) > limit:  # a stream, or a file that grew since its size was read
        raise ColibriError(f"{path}{what} holds more than the {format_bytes(limit)} such a file may be{fix}")
    return data


def read_text(path: str | os.PathLike, limit: int, what: str = "", fix: str = "") -> str:
    """`read_bounded`, decoded as UTF-8 (text that is not: one line naming the file)."""
    try:
        return read_bounded(path, limit, what, fix).decode("utf-8")
    except UnicodeDecodeError:
        what, fix = _said(what, fix)
        raise ColibriError(f"{path}{what} is not UTF-8 text (damaged?){fix}") from None


def read_json(path: str | os.PathLike, fix: str = "", what: str = "", limit: int = CONFIG_BYTES) -> object:
    """The JSON document in `path` (at most `limit` bytes: `read_bounded`); anything unusable (not
    UTF-8, not JSON, nested too deeply to parse) is a one-line `ColibriError` naming the file, what it
    is and `fix`."""
    text = read_text(path, limit, what, fix)
    what, fix = _said(what, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ColibriError(f"{path}{what} is not valid JSON ({e.msg} at line {e.lineno}){fix}") from None
    except (RecursionError, ValueError) as e:  # nested deeper than the parser goes; numbers it cannot hold
        why = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())[:120]
        raise ColibriError(f"{path}{what} is not usable JSON ({why}){fix}") from None


def _said(what: str, fix: str) -> tuple[str, str]:
    """How an error line says what a file is (after its name) and the fix (at its end)."""
    return (f" ({what})" if what else "", f": {fix}" if fix else "")


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
