"""Errors that reach a user.

`UserError` is raised for anything the caller can fix (bad arguments, a missing model, a corrupt file).
The command line turns it into a one-line message and exit code 2 instead of a traceback; from Python it
is an ordinary exception with a message that says what to do.
"""


class UserError(ValueError):
    """A mistake in the caller's input or set-up, with a message that says how to fix it."""
