"""The actors: the trio scheduler that executes the core's commands, the writer and reader
pools and the worker threads they run on, the remote tier's fetcher and publisher, and the
completion gate that orders their reports back into the core.

Owns concurrency: which task or thread does what, and when a completion reaches the core.
May import storage/, memory/, tracing/ and statekv; never the facades above it
(io_actors.embed, io_actors.config, io_actors.metrics) or tensor_parallel/.
"""
