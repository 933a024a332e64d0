"""`python -m minedraft.cli` (the same as `python -m minedraft`)."""

import sys

from minedraft.cli import main

sys.exit(main())
