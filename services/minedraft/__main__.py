import sys

from minedraft.cli import main

sys.exit(main())
