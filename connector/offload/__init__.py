"""The direct mode: kvstore as vLLM's offloading medium, an ``OffloadingSpec`` of its own.

vLLM's OffloadingConnector (:class:`connector.offload.vllm_connector.KVStoreConnector`, which
also loads the secondary tier's ``TieringOffloadingSpec``) builds
:class:`connector.offload.spec.KVStoreSpec`: a scheduler-side manager that keeps an index of
the store and publishes blocks, and a worker per rank that writes and reads them straight
between the GPU's KV cache and the store. vLLM configs name both through the package
``connector`` (``"kv_connector": "KVStoreConnector"``, ``"spec_name": "KVStoreSpec"``, module
path ``"connector"``).

Modules: ``spec`` and ``vllm_connector`` (what vLLM loads), ``manager`` (scheduler side),
``admission`` (``admit_after``), ``events`` (kv-cache events of published and vanished
blocks), ``metrics`` (the ``vllm:kvstore_*`` series, load-failure causes),
``transfer_specs`` (the picklable load/store job specs the scheduler sends the workers),
``worker`` / ``executor`` (the job threads) / ``deadlines`` (jobs on a hung store) /
``streams`` (ordering against the compute stream) / ``job_blocks`` (a job's GPU blocks) on the
worker side.

What both modes share lies in :mod:`connector` itself (``compat``, ``config``, ``facts``,
``identity``, ``keys``, ``rank``, ``store``); this package never imports
:mod:`connector.tier`, nor the tier this one (lint-imports).
"""
