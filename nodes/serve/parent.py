"""A child process of a launcher (`mlx.launch`, `torchrun`) that never outlives it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent exits
PARENT_POLL_S = 1.0  # elsewhere: how often the watch looks


def die_with_parent() -> None:
    """SIGTERM to this rank once the process that started it (`mlx.launch`, `torchrun`, or
    a service manager) is gone, however it went (issue 47: a launcher's SIGTERM left both ranks
    serving). Linux: the kernel's parent-death signal; elsewhere (macOS) a thread watching
    the parent id."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it went before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)
