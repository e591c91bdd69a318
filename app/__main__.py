"""`python -m tandem.app`: the `tandem` command, as the console script runs it."""

import sys

from tandem.app.cli.main import main

sys.exit(main())
