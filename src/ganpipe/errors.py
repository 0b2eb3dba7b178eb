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


class TrainingDivergedError(UserError, FloatingPointError):
    """A loss or a weight became NaN or infinite: the message names the step, the strategy,
    the loss and precision, and what to lower. The last good checkpoint is kept."""


#: What the entry points (the stages and the ``ganpipe`` command) report as one ``error:``
#: line with exit status 2. Only this: a built-in exception (a ``ValueError`` from deep in
#: torch, a ``FileNotFoundError`` nobody anticipated) is a bug, shown with its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (UserError,)
