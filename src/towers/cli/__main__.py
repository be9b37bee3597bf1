"""``python -m towers.cli``: the ``towers`` command."""

import sys

from towers.cli import main

if __name__ == "__main__":
    sys.exit(main())
