#!/usr/bin/env python3
"""Front-end of the kvstore benchmarks (logic in kvstore.bench); ``--help`` lists options."""

import sys

from kvstore.bench import main

if __name__ == "__main__":
    sys.exit(main())
