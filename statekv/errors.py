"""The exception hierarchy.

Everything statekv raises derives from StateKVError.  Errors raised at the boundary name the
field or id at fault, and are raised before anything is changed: a call that raises left the
cache as it was.
"""

from __future__ import annotations


class StateKVError(Exception):
    """Base of every error statekv raises."""


class ConfigError(StateKVError, ValueError):
    """A configuration value is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def renamed(self, field: str) -> ConfigError:
        """The same error (same class) naming `field`: an inner layer's parameter name
        becomes the public field the user set."""
        return type(self)(field, self.message)


class DirectoryInUse(ConfigError):
    """Another cache (another process, or another store in this one) holds the slot
    directory: two caches sharing slots would overwrite each other's KV."""


class NewerFormat(ConfigError):
    """The slot directory was written by a newer statekv (a newer slot format version)."""


class UsageError(StateKVError, ValueError):
    """The caller broke the API's contract (unknown request id, bad argument...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OutOfBlocks(StateKVError):
    """A `_nowait` operation could not get enough GPU pages; nothing was changed."""

    def __init__(self, request_id: str, needed: int, available: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed} more GPU blocks, {available} obtainable"
        )
        self.request_id = request_id
        self.needed = needed
        self.available = available


class TransferFailed(StateKVError):
    """A backend transfer failed (I/O error, short read or write, checksum mismatch)."""

    def __init__(self, what: str, cause: str) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what
        self.cause = cause


class InvariantViolation(StateKVError, AssertionError):
    """statekv's own bug: an internal invariant does not hold."""


class IllegalTransition(InvariantViolation):
    """An event arrived for a block in a state whose transition table has no such entry."""

    def __init__(self, block: int, state: object, event: object) -> None:
        super().__init__(f"block {block}: event {event} is not allowed in state {state}")
        self.block = block
        self.state = state
        self.event = event
