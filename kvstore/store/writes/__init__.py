"""The write strategies of :class:`kvstore.store.publish.Publisher`, one module each.

The array's plan (:mod:`kvstore.store.plan`) says which an array may use; the request's buffer
says which it takes. Every one leaves the same file as the step-by-step path.

* :mod:`.batch`: a batch of whole blocks given as rows (or small buffers), written and named in
  one native call per I/O thread (stores without durability); what it cannot finish goes
  through the step-by-step path.
* :mod:`.hashed`: a large raw dense block of host memory, checksummed group by group as it is
  written.
* :mod:`.headers`: the per-thread header pages the other writes build headers in.
"""
