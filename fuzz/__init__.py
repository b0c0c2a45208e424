"""Deterministic race fuzzing of statekv against its specification.

Three harnesses, one reference model (``specs.reference_model``):

* :mod:`fuzz.core_machine`: the pure core against the model, thousands of steps a second;
* :mod:`fuzz.system_machine`: the real actors, real files, real torch copies, with every
  transfer's completion held at the backend seam so that Hypothesis picks which pending
  write or read lands next, and faults injected at the store;
* :mod:`fuzz.thread_soak`: the same system with real worker threads, random delays and
  random faults, for interleavings the gated machine cannot create.

``python -m fuzz --help`` runs them under a profile (``ci``, ``soak``, ``gpu``); see
fuzz/README.md.
"""
