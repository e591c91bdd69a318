"""tandem's node side: model description, wire format, events, and the prefill/decode roles."""

__version__ = "0.1.0"
