#!/usr/bin/env python3
"""Front-end of the ``kvstore-inspect`` command (logic in kvstore.inspect.cli)."""

import sys

from kvstore.inspect.cli import main

if __name__ == "__main__":
    sys.exit(main())
