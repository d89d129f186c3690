"""Format v1 and the page store (docs/design.md §4-6). Modules, one job each:

* :mod:`.format` - the bytes of a shard file: header, layout of inner chunks, sharding index;
* :mod:`.codec` - compressed inner chunks: the blosc codec, size bounds, the packed index;
* :mod:`.paths` - every on-disk name (block, temporary, quarantine, trash) and the one listing;
* :mod:`.metadata` - the zarr v3 documents (root, namespace, array);
* :mod:`.check` - the hot-path block check: header and chunk checks, raising at the first;
* :mod:`.full_check` - the tools' offline check: every fault of a file, never raising;
* :mod:`.view` - a read-only view of a store directory (admin and inspect open stores with it);
* :mod:`.page_store` - opening a store and its namespaces for serving (``KVStore``);
* :mod:`.group_store` - the block operations of one group array (``GroupStore``, a facade over):
  :mod:`.array` (what one group array is), :mod:`.lookup` (existence probes, longest prefix),
  :mod:`.publish` (whole-block writes), :mod:`.pending` (the multi-writer protocol),
  :mod:`.files` (the file steps both share: headers, writing, naming, finishing a batch),
  :mod:`.read` (verified reads and quarantine), :mod:`.compression` (compressed blocks),
  :mod:`.segments` (caller buffers as file segments);
* :mod:`.types` - requests, results, pending-block descriptors, counters.
"""
