"""Errors that mean "your input is wrong", as opposed to bugs.

Entry points print these as one line (no traceback) and exit before any compute.
"""


class SchedulingError(ValueError):
    """A primitive was misused; the message starts with the schedule path."""


class ConfigError(ValueError):
    """Arguments that contradict each other or the model/world they describe."""


class DataError(ConfigError):
    """Missing, corrupt or unusable training data."""


class CheckpointError(ConfigError):
    """A checkpoint that is missing, corrupt or does not fit this run."""
