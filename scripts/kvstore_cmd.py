#!/usr/bin/env python3
"""Front-end of the ``kvstore`` command (logic in kvstore.cli); installed as ``kvstore``."""

import sys

from kvstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
