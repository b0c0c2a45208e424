"""Bytes at rest: the slot format, the slot stores (POSIX O_DIRECT, kvikio, the shared Redis
Cluster tier) and their fault-injecting twins, the record files and the two journals they
keep, the ownership rule for their files, and the interfaces the actors call them through.

Owns what is on disk (or in the shared tier) and how it is recovered after a crash; knows
nothing of tasks or of the core's lifecycle.  May import statekv only: memory/, actors/ and
everything above import this layer, never the other way.
"""
