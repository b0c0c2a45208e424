"""The top layer: the ``statekv`` command and the OpenAI-compatible server.

Installed as ``statekv_serve`` (a top-level ``serve`` package would shadow users' own).  It
sits above everything it runs: the cache (``io_actors``), the model and the serving loop
(``statekv_models``); nothing below imports it.
"""
