"""Library errors as text for one-line messages (they often span lines: the cause comes last)."""


def error_lines(err: BaseException) -> list[str]:
    """The non-blank lines of `err`'s message, stripped."""
    return [line.strip() for line in str(err).splitlines() if line.strip()]


def last_line(err: BaseException) -> str:
    """The last non-blank line of `err`'s message (its class name when it has none)."""
    lines = error_lines(err)
    return lines[-1] if lines else type(err).__name__


def one_line(err: BaseException) -> str:
    """`err`'s message with every run of whitespace (newlines too) made one space."""
    return " ".join(str(err).split())
