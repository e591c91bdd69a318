"""`python -m tandem`: the `tandem` command, as `python -m tandem.app` (so `torchrun
--nproc-per-node 2 -m tandem node --role prefill ...` starts a prefill node's ranks). The one
file of this folder: `tandem` stays a namespace package (no `__init__.py`)."""

import sys

from tandem.app.cli.main import main

sys.exit(main())
