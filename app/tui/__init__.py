"""The Textual dashboard (`tandem tui`): cluster, layer pipeline, bandwidth and chat.

Only `command.py` is imported by the CLI at start-up; it imports Textual when the command
runs, so `tandem --help` never loads it.
"""
