"""The read strategies of :class:`kvstore.store.read.Reader`, one module each.

Each takes one kind of request and does all of it: the buffer's checks, the file read, the
header's check and every chunk's checksum, in the order and with the errors every other
strategy has. The array's plan (:mod:`kvstore.store.plan`) says which an array may use; the
request's buffer says which it takes:

* :mod:`.batch`: a batch of whole blocks into rows (or small buffers), one native call per I/O
  thread; what it cannot finish goes through the others, block by block.
* :mod:`.whole`: a whole block of a raw dense array into one host buffer.
* :mod:`.hashed`: the same for a large block, checksummed piece by piece as it is read.
* :mod:`.strided`: a whole block straight into a strided numpy view (a row of pieces).
* :mod:`.general`: the rest: chosen chunks, padded layouts, compressed arrays, device tensors.

:mod:`.context` holds what they share (the array, per-thread header buffers, touch times).
"""
