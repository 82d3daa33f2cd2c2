"""``python -m fnloop``: the ``fnloop`` command (``fnloop.cli``)."""

import sys

from fnloop.cli import main

if __name__ == "__main__":
    sys.exit(main())
