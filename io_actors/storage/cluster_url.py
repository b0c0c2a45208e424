"""Cluster URLs of the shared tier, read without redis-py (the configuration checks them
whether or not the optional client is installed)."""

from __future__ import annotations

import urllib.parse
from typing import Final

import attrs

from statekv.errors import ConfigError

SCHEMES: Final = ("redis",)
MAX_TIMEOUT_S: Final = 60.0
"""The longest network wait the shared tier accepts (seconds)."""


@attrs.frozen(kw_only=True)
class ClusterAddress:
    host: str
    port: int


def parse_cluster_url(url: object, *, field: str = "url") -> tuple[ClusterAddress, ...]:
    """The startup nodes of a cluster URL: ``redis://host:port`` or several, comma-separated.

    raises: ConfigError(field) for anything else (a database number, a password in the
    clear, a path, a port out of range...).  One reachable node is enough for the client to
    learn the whole cluster; listing every master lets a replica start while one is down.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(field, f"must be a non-empty redis:// URL, got {url!r}")
    nodes: list[ClusterAddress] = []
    for part in url.split(","):
        text = part.strip()
        try:
            parsed = urllib.parse.urlsplit(text)
            port = parsed.port
        except ValueError as exc:
            raise ConfigError(field, f"{text!r} is not a valid URL: {exc}") from None
        if parsed.scheme not in SCHEMES:
            raise ConfigError(
                field, f"{text!r}: scheme must be one of {list(SCHEMES)}, got {parsed.scheme!r}"
            )
        if not parsed.hostname:
            raise ConfigError(field, f"{text!r} names no host")
        if port is None or not 1 <= port <= 65535:
            raise ConfigError(field, f"{text!r} must name a port in [1, 65535]")
        if parsed.path not in ("", "/"):
            raise ConfigError(
                field, f"{text!r}: a Redis Cluster has only database 0; drop {parsed.path!r}"
            )
        if parsed.query or parsed.fragment or parsed.username or parsed.password:
            raise ConfigError(
                field, f"{text!r}: credentials, queries and fragments are not supported"
            )
        nodes.append(ClusterAddress(host=parsed.hostname, port=port))
    return tuple(nodes)
