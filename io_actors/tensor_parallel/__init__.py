"""Tensor-parallel agreement: one cache per rank, and the cross-rank checks that keep their
allocations, failures and completions identical (torch.distributed object collectives).

Sits above the facades: it wraps each rank's io_actors.embed.BlockingCache.  May import the
facades, actors/, storage/ and statekv; nothing in io_actors imports it.
"""
