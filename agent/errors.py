"""How the ``liubai`` commands fail: exit codes, the usage error, and the one-line message.

Every command ends with one of these codes: 0 success, 1 a runtime failure (``EngineError``,
``MemoryLayerError``, bad input found while running), 2 a usage error, 130 interrupted (Ctrl-C).
A user error is one ``liubai: error: ...`` line on stderr, never a traceback.
"""

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ValueError):
    """Arguments that parse but make no sense together; exits 2 like argparse's own errors."""


def one_line(exc: BaseException | str) -> str:
    """An error's message on exactly one line (or its type's name when it says nothing)."""
    text = " ".join(str(exc).split())
    if text or isinstance(exc, str):
        return text
    return type(exc).__name__


def error_line(exc: BaseException | str, prog: str = "liubai") -> str:
    """``liubai: error: <message>``, the line a failing command writes to stderr."""
    return f"{prog}: error: {one_line(exc)}"
