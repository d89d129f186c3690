"""I/O engines moving block bytes between memory and files.

``engine`` (the contract), ``host``, ``pinned`` and ``gds`` (the engines), ``select`` (the
one-time choice by ``io_mode``), ``staging`` (where batches of rows sit), ``device`` and
``cufile`` (CUDA and kvikio behind replaceable objects), ``buffers`` and ``fileio`` (aligned
host memory, every file-system call). See docs/engines.md.
"""
