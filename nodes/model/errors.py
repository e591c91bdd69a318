"""The one error type of the model boundary."""

from __future__ import annotations


class ModelError(Exception):
    """A model directory that tandem cannot use. The message names the file and the problem."""
