"""``kvstore-inspect``: look inside a store directory cold, read only (docs/design.md §1, user 3).

Works on a store copied from another machine, with neither vLLM nor a GPU. Nothing in this
package writes to a store: no probe files, no directories, no quarantine (stores are opened
through the read-only :mod:`kvstore.store.view`). Modules, one job each:

* :mod:`.blockfile` - verify one shard file and read its chunks, reporting damage (the one
  block check, :mod:`kvstore.store.full_check`);
* :mod:`.resolve` - namespace names, hash prefixes, head / layer ranges;
* :mod:`.decode` - stored bits to numpy / torch arrays of the real dtype;
* :mod:`.values`, :mod:`.stats` - decoded selections and their statistics;
* :mod:`.rank` - a block as one rank of a parallel layout holds it (kvstore.layout);
* :mod:`.overview`, :mod:`.tree`, :mod:`.block`, :mod:`.diff` - the views' documents;
* :mod:`.pictures` - PNG heatmaps and prefix-forest pictures;
* :mod:`.export` - .npy / .safetensors export;
* :mod:`.render`, :mod:`.text` - JSON and text output; :mod:`.cli` - the command.
"""
