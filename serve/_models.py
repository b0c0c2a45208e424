"""The model package, under the name it has where it runs.

Installed, ``models/`` is the package ``statekv_models``; mypy reads this source tree, where it
is ``models`` (it cannot follow an editable install's import hook).  Importing it here, once,
keeps the dependency of this layer on the one below visible to readers and to the type
checker, and the one place that knows both names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models import chat_run, config, demo, model, sampling, serving_loop
else:
    from statekv_models import chat_run, config, demo, model, sampling, serving_loop

__all__ = ["chat_run", "config", "demo", "model", "sampling", "serving_loop"]
