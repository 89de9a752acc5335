"""Giving memory back to the system: a long-running server's resident size should follow what it
holds, not the largest requests it has seen. Both calls are glibc's; elsewhere they do nothing."""
import ctypes

__all__ = ["return_large_buffers", "trim"]

try:
    _libc = ctypes.CDLL(None)
    _mallopt, _malloc_trim = _libc.mallopt, _libc.malloc_trim
except (AttributeError, OSError):  # not glibc
    _mallopt = _malloc_trim = None

M_MMAP_THRESHOLD = -3  # mallopt's parameter number


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
