"""Device and host memory: the preallocated KV page pools and the engine that copies pages
between them on a dedicated CUDA stream.

Owns every tensor the cache allocates for KV, and the fences that order copies against the
forward pass.  May import storage/ (the interfaces it implements, the slot format's device
checksum, page-aligned host buffers) and statekv; the actors and facades import it.
"""
