"""User-facing errors: one line saying what is wrong and how to fix it, exit code 2.

Anything raised as `UserError` is printed by the CLI without a traceback; everything else is a
bug in moeplan and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input (file, model, flags) rather than a bug in moeplan."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
