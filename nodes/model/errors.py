"""The one error type of the model boundary."""

from __future__ import annotations


class ModelError(Exception):
    """A model directory that tandem cannot use, or a model named that is not on this machine.
    The message, one line, names the file and the problem (or the id and where it looked)."""
