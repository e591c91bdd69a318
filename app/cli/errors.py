"""The one error a command raises for bad input; `tandem` prints it as one line, exit status 2.

A module of its own so that commands outside `app/cli/` (the dashboard's) can raise it without
importing the parser that dispatches to them.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
