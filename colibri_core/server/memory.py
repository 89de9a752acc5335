"""Giving memory back to the system: a long-running server's resident size should follow what it
holds, not the largest requests it has seen. `BodyBudget` bounds what request bodies hold while
they arrive, across all connections, and gives their pages back once a burst of them is over.
`return_large_buffers` and `trim` are glibc's calls; elsewhere they do nothing."""
import asyncio
import ctypes

__all__ = ["BodyBudget", "return_large_buffers", "trim"]

try:
    _libc = ctypes.CDLL(None)
    _mallopt, _malloc_trim = _libc.mallopt, _libc.malloc_trim
except (AttributeError, OSError):  # not glibc
    _mallopt = _malloc_trim = None

M_MMAP_THRESHOLD = -3  # mallopt's parameter number
TRIM_AFTER_BYTES = 16 << 20  # bodies read since the last trim that make one worth its few ms
TRIM_DELAY = 0.5  # seconds after the last body of a burst was read: its handlers have parsed and dropped it


def return_large_buffers(threshold: int = 1 << 20) -> None:
    """Serve every block of `threshold` bytes or more with its own mmap, unmapped when freed. By
    default glibc raises that threshold to the largest block freed so far (up to 32 MiB): after
    one large request body the next ones are carved from the heaps, which keep their pages.
    Setting the threshold turns that adjustment off."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, threshold)


def trim() -> None:
    """Give the free pages inside malloc's heaps back to the system (a few ms: call it when idle).
    Without it, the pages freed by a turn stay resident in whichever heap served them, and an idle
    server's RSS drifts by tens of MiB with the order in which requests came."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class BodyBudget:
    """The request body bytes all connections together may hold while their bodies arrive.

    A body takes its bytes as they arrive and gives them back once it is read or refused; one whose
    next chunk (or declared length) does not fit in what is left is refused at once (the server's
    503 with Retry-After), so many large bodies at once cannot grow the process beyond `limit` (each
    connection's own bound is `max_body_bytes`). Only bytes that arrived are held: a client that
    declares a large body and sends nothing holds none of the budget. A body arrives in many small
    chunks from malloc's heaps, which keep their pages when freed: once no body is arriving and
    enough were read since, `trim` runs (on a thread), so RSS returns to idle after a burst even if
    no turn follows it. Used on the event loop only: no lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes taken by bodies still arriving
        self._read = 0  # bytes given back since the last trim
        self._trim_due = False

    def take(self, n: int) -> bool:
        """Take `n` more bytes for a body; False (nothing taken) if that would pass the limit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        """Give back `n` bytes a body had taken (it was read, refused, or its client went)."""
        self.held -= n
        self._read += n
        if self.held == 0 and self._read >= TRIM_AFTER_BYTES and not self._trim_due:
            self._trim_due = True
            asyncio.get_running_loop().call_later(TRIM_DELAY, self._trim)

    def _trim(self) -> None:
        self._trim_due = False
        if self.held:  # another burst began: trimmed when it ends
            return
        self._read = 0
        asyncio.get_running_loop().run_in_executor(None, trim)
