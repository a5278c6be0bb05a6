"""User-facing errors: one line saying what is wrong and how to fix it, exit code 2.

Anything raised as `UserError` is printed by the CLI without a traceback; everything else is a
bug in moeplan and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input (file, model, flags) rather than a bug in moeplan."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def one_line_usage_error(exc) -> str:
    """Click's usage error (`Invalid value for '--nodes': 'abc' is not a valid integer.`) as one
    line that also says where to look for the right form."""
    from moeplan.core.cli_types import OneLineType

    param = getattr(exc, "param", None)
    if param is not None and isinstance(param.type, OneLineType) and getattr(exc, "param_hint", None) is None:
        name = param.opts[0] if param.opts else param.name
        message = f"{name} {' '.join(str(exc.message).split())}"
    else:
        message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command_path:
        message += f" (see '{ctx.command_path} --help')"
    return message
