"""The demo's second process: ``python -m kvstore.demo --read-phase SPEC_JSON``.

:func:`kvstore.demo.run` starts it after the write phase, as a restarted server: a new
interpreter that opens the store cold, reads the workload back and prints the read phase's
result as one JSON object. Not meant to be run by hand (``kvstore demo`` is).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from kvstore.demo import DemoSpec, read_phase


def read_phase_main(argv: Sequence[str]) -> int:
    """Run the read phase of the spec in ``argv`` (one JSON argument); print its result."""
    (spec_json,) = argv
    print(json.dumps(read_phase(DemoSpec.from_json(spec_json))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--read-phase":
        sys.exit(read_phase_main(sys.argv[2:]))
    sys.exit("usage: kvstore demo (this module is the demo's second process)")
