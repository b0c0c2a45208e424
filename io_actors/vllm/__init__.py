"""statekv under vLLM: the KV connector and what it needs.

The top layer of io_actors/: it may import the facades, tensor-parallel agreement, the actors,
the memory pools, storage, tracing and statekv; nothing below imports it.  vLLM itself is
imported only by the connector module, so the layout adapter runs (and is tested) without it.
"""
