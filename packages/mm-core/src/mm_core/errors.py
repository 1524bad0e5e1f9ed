"""Errors meant for users: each says what is wrong, where, and what to do.

The ``mm`` command line prints an :class:`MMError` as one line and exits with status 2, without a
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MMError(Exception):
    """An error the user can fix (bad config, bad data, missing plugin, ...)."""


class ConfigError(MMError):
    """A configuration value is wrong; the message names the full dotted key."""


class PluginError(MMError):
    """A plugin is unknown, registered twice, or fails to import."""


class DataError(MMError):
    """A data file or record is malformed; the message names the file and line (or record)."""


class CheckpointError(MMError):
    """A checkpoint is missing, incomplete, or does not match the model."""


class NonFiniteError(MMError):
    """The loss, the gradient norm or the weights stopped being finite; training stops without publishing."""


class TrainingInterrupted(Exception):  # noqa: N818 (not an error: a requested, clean stop)
    """SIGTERM/SIGINT stopped training after a complete step (and its checkpoint, when saving is on)."""
