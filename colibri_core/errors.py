"""The one exception type users see.

A `ColibriError` is a user-facing problem (bad input, missing plugin, corrupt file). Its message is
one line that says what is wrong and, where it can, what to do; the CLI prints it on stderr and exits
with status 1, never a traceback. Anything else escaping is a bug.
"""

__all__ = ["ColibriError"]


class ColibriError(Exception):
    """A problem the user can fix; `str(err)` is one line."""
