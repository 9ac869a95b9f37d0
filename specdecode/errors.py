"""Errors that reach a user.

`UserError` is raised for anything the caller can fix (bad arguments, a missing model, a corrupt file).
The command line turns it into a one-line message and exit code 2 instead of a traceback; from Python it
is an ordinary exception with a message that says what to do.
"""


class UserError(ValueError):
    """A mistake in the caller's input or set-up, with a message that says how to fix it."""


class ConstraintError(UserError):
    """A constraint (a schema, expression, grammar or a tool call's form) that the output cannot follow, found
    while generating; `param` names the request field it came from where the caller knows it (the server)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
