"""The one base class of the errors a user can fix.

A :class:`UserError` says what is wrong with the user's params, files, data or machine, and
the fix, in its message: the stages print it as one ``error:`` line and exit with status 2.
Every other exception is a bug (or a failure nobody anticipated) and keeps its traceback,
so it is never mistaken for the user's own mistake.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix; the message names the key or file, the value and the fix.

    A ``ValueError`` too, for callers that catch bad values generally; the stages map only
    this class to a one-line error.
    """


#: What the entry points (the stages and the ``ganpipe`` command) report as one ``error:`` line
#: with exit status 2: :class:`UserError`, and the plain ``ValueError``, ``FileNotFoundError``
#: and ``FloatingPointError`` of the raise sites not yet converted to it.
USER_ERRORS: tuple[type[Exception], ...] = (
    UserError,
    ValueError,
    FileNotFoundError,
    FloatingPointError,
)
