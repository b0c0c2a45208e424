"""statekv under vLLM: the KV connector and what it needs.

``io_actors.vllm.connector.StateKVConnector`` is the class vLLM loads
(``--kv-transfer-config '{"kv_connector": "StateKVConnector", "kv_connector_module_path":
"io_actors.vllm.connector", ...}'``).  It is a thin shell over two halves that never import
vLLM, so that they are typed and tested without it:

* :mod:`io_actors.vllm.scheduler_side` -- in vLLM's engine-core process: owns the core
  (:class:`statekv.engine_tiers.EngineTiers`), answers what the tiers can supply, records
  where loads go, stamps and saves finished requests, and turns the workers' reports into
  completions;
* :mod:`io_actors.vllm.worker_side` -- in each worker process: the pinned host pool, the
  slot store and its reader and writer threads, and the copies between vLLM's paged KV
  tensors and statekv's pages (:mod:`io_actors.vllm.layouts`);
* :mod:`io_actors.vllm.plans` -- the data each step carries between them;
* :mod:`io_actors.vllm.settings` -- ``kv_connector_extra_config`` -> StateKVConfig.

The top layer of io_actors/: it may import the facades, tensor-parallel agreement, the actors,
the memory pools, storage, tracing and statekv; nothing below imports it.  vLLM itself is
imported only by the connector module.
"""
