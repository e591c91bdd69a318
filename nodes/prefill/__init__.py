"""The prefill side (torch).

MKL sizes its thread team by the machine's load unless told not to (`MKL_DYNAMIC`), and a
GEMM split over fewer threads sums in another order: on a busy machine the same prompt then
gave K/V a few 1e-4 apart from run to run (seen as rows past T/2 differing). The prefill keeps
a fixed team so its numbers depend on the inputs alone. This must precede torch's import.
"""

import os

os.environ.setdefault("MKL_DYNAMIC", "FALSE")
