"""The prefill side's refusals of a request: the caller's fault, not the node's."""

from __future__ import annotations


class PrefillError(ValueError):
    """A request the engine refuses (bad tokens, bad prefix): the caller's fault."""


class PromptTooLong(PrefillError):
    """A prompt whose activations do not fit the room reserved for them (HTTP 413)."""
