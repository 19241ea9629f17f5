"""The one exception family of greyhound.

Library code raises a subclass of :class:`GreyhoundError` with a one-line message that
says what is wrong and what is allowed; only the CLI turns it into a stderr line and an
exit code.
"""


class GreyhoundError(Exception):
    """Base of every error greyhound reports to a user."""


class InputError(GreyhoundError):
    """A file, option or value given by the user is malformed."""


class SlurmError(GreyhoundError):
    """A Slurm command failed or answered something unexpected."""


class OutputError(GreyhoundError):
    """A file or directory greyhound was asked to write cannot be written."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for a one-line error (a KeyError's key
    without its quotes), or the exception's type when it has no message."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def read_input_file(path, *, expected: str, missing: str = "no such file", max_bytes: int = -1) -> bytes:
    """The bytes of a file the user named (at most ``max_bytes``), or an InputError that
    says why not: ``missing`` when it does not exist, a directory where ``expected`` (a
    CSV file, the meta YAML file, ...) was, or the system's reason."""
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes)
    except FileNotFoundError:
        raise InputError(f"{path}: {missing}") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected {expected}") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
