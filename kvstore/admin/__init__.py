"""Offline administration of a store directory, safe while servers read and write it.

One module per job; the ``kvstore`` command (:mod:`kvstore.cli`) parses arguments and calls
each module's ``run``:

* :mod:`~kvstore.admin.scan` - walk a store cold (opened as :mod:`kvstore.store.view`):
  blocks, temp, foreign and held files;
* :mod:`~kvstore.admin.usage` - what files hold: apparent and allocated bytes of an entry or a tree;
* :mod:`~kvstore.admin.blockfile` - a verdict per block file (:mod:`kvstore.store.full_check`);
* :mod:`~kvstore.admin.sizes` - ``10G`` / ``500MiB`` and ``7d`` / ``12h``, and printing them;
* :mod:`~kvstore.admin.ls`, :mod:`~kvstore.admin.du` - what is in it, where the bytes are;
* :mod:`~kvstore.admin.verify` - is it intact (``--fix`` quarantines and sweeps);
* :mod:`~kvstore.admin.eviction` - which blocks go: the block index and the LRU-leaves policy;
* :mod:`~kvstore.admin.gc` - bound it by size or age, once or ``--watch``;
* :mod:`~kvstore.admin.rm` - remove a namespace;
* :mod:`~kvstore.admin.trash` - the two-phase deletion protocol gc and rm share;
* :mod:`~kvstore.admin.commands` - their arguments, registered on :mod:`kvstore.cli`.

``docs/admin.md`` is the operator's reference.
"""
