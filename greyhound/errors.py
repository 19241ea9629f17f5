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
