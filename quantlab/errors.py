"""The one exception type that reaches the user.

A `UserError` is a problem with the user's input (recipe, files, model id, offline hub): the
CLI prints its message as one line and exits with code 2, never a traceback. Anything else
that escapes is a quantlab bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, described in one line that names the field, file or value and what is valid."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))
