"""The direct mode: kvstore as vLLM's offloading medium, an ``OffloadingSpec`` of its own.

vLLM's OffloadingConnector (:class:`connector.offload.vllm_connector.KVStoreConnector`, which
also loads the secondary tier's ``TieringOffloadingSpec``) builds
:class:`connector.offload.spec.KVStoreSpec`: a scheduler-side manager that keeps an index of
the store and publishes blocks, and a worker per rank that writes and reads them straight
between the GPU's KV cache and the store. vLLM configs name both through the package
``connector`` (``"kv_connector": "KVStoreConnector"``, ``"spec_name": "KVStoreSpec"``, module
path ``"connector"``).

Modules: ``spec`` and ``vllm_connector`` (what vLLM loads); on the scheduler side ``manager``,
``probes`` (batched existence probes), ``publishes`` (the publish jobs), ``publish_ledger``
(the blocks handed to the store until counted, and its unresponsive episodes), ``admission``
(``admit_after``), ``events`` (kv-cache events of published and vanished blocks), ``metrics``
(the ``vllm:kvstore_*`` series, load-failure causes); ``transfer_specs`` (the picklable
load/store job specs the scheduler sends the workers); on the worker side ``worker`` /
``executor`` (the job threads) / ``outcomes`` (a job's outcome and the failures reported) /
``deadlines`` (jobs on a hung store) / ``streams`` (ordering against the compute stream) /
``job_blocks`` (a job's GPU blocks).

What both modes share lies in :mod:`connector` itself (``compat``, ``config``, ``facts``,
``identity``, ``keys``, ``rank``, ``store``); this package never imports
:mod:`connector.tier`, nor the tier this one (lint-imports).
"""
