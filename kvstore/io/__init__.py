"""I/O engines moving block bytes between memory and files.

``engine`` (the contract) and ``types`` (its segment and probe types), ``host``, ``pinned``
and ``gds`` (the engines), ``newfile`` (how a new file is cut into direct and buffered writes),
``select`` (the one-time choice by ``io_mode``), ``staging`` (where batches of rows sit),
``device`` and ``cufile`` (CUDA and kvikio behind replaceable objects), ``align`` (the 4 KiB
the engines need and the on-disk format adopts), ``buffers`` (aligned host memory),
``fileio`` (every file-system call, in one replaceable object), ``entries`` (what a name in a
hostile tree holds: kinds, file identities, no-follow directories, identity-checked moves and
removals) and ``rename`` (the no-replace rename that publishes). See docs/engines.md.
"""
