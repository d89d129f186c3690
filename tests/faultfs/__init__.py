"""faultfs: a FUSE passthrough file system whose lookups, reads and writes can be frozen or
delayed on command, to test kvstore on a slow or hung mount (issue 35).

* :mod:`tests.faultfs.gate` - the rules (freeze, delay per operation class and path glob) and
  the gate every file-system operation passes; plain Python, no FUSE.
* :mod:`tests.faultfs.daemon` - the passthrough served by fusepy, run in its own process
  (``python -m tests.faultfs.daemon``): a frozen operation blocks a thread of that process,
  never the test's.
* :mod:`tests.faultfs.mounts` - unmounting and finding mount points (no FUSE import).
* :mod:`tests.faultfs.handle` - :class:`~tests.faultfs.handle.FaultFS`, the test's side: mounts,
  sends commands, unmounts without ever leaving a hung mount behind.
* :mod:`tests.faultfs.fixture` - the ``faultfs`` pytest fixture (skips where FUSE is missing).
* :mod:`tests.faultfs.child` - child processes on the mount, watched without blocking the test.
"""
