"""Cluster URLs of the shared tier, read by redis-py's own URL parser.

``redis://[user@]host:port`` (or ``rediss://`` for TLS), several comma-separated: the startup
nodes of one Redis Cluster.  Each part goes through ``redis.connection.parse_url``; what a
cluster cannot use (a database number, a query) and what must not be written in a URL (a
password: URLs are logged and shown in configurations) is refused naming the field.  The
password comes separately (``StateKVConfig.remote_password``, read from a file or the
environment at the entry point).
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from statekv.errors import ConfigError

SCHEMES: Final = ("redis", "rediss")
MAX_TIMEOUT_S: Final = 60.0
"""The longest network wait the shared tier accepts (seconds)."""


@attrs.frozen(kw_only=True)
class ClusterAddress:
    host: str
    port: int


@attrs.frozen(kw_only=True)
class ClusterTarget:
    """What a cluster URL says: the startup nodes, the ACL user, and whether TLS is on."""

    nodes: tuple[ClusterAddress, ...]
    username: str | None = None
    tls: bool = False


def _parse_url(text: str) -> dict[str, Any]:
    try:
        from redis.connection import parse_url
    except ImportError as exc:
        raise ConfigError("url", "the shared tier needs redis-py: pip install "
                          f"'statekv[redis]' ({exc})") from None
    result: dict[str, Any] = parse_url(text)  # type: ignore[no-untyped-call]
    return result


def parse_cluster(url: object, *, field: str = "url") -> ClusterTarget:
    """The startup nodes, user and TLS setting of a cluster URL.

    raises: ConfigError(field) for anything else (a database number, a password in the URL,
    a query, a port out of range, schemes or users that differ between nodes...).  One
    reachable node is enough for the client to learn the whole cluster; listing every master
    lets a replica start while one is down.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(field, f"must be a non-empty redis:// or rediss:// URL, got {url!r}")
    nodes: list[ClusterAddress] = []
    users: set[str | None] = set()
    schemes: set[str] = set()
    for part in url.split(","):
        text = part.strip()
        shown = _without_password(text)  # what an error may repeat
        scheme = text.partition("://")[0] if "://" in text else ""
        if scheme not in SCHEMES:
            raise ConfigError(
                field, f"{shown!r}: scheme must be one of {list(SCHEMES)}, got {scheme!r}"
            )
        try:
            parsed = _parse_url(text)
        except ConfigError as exc:
            raise exc.renamed(field) from None
        except ValueError as exc:
            raise ConfigError(field, f"{shown!r} is not a valid URL: {exc}") from None
        if parsed.get("password"):
            raise ConfigError(
                field, f"{shown!r}: a password does not go in the URL (it "
                "would be logged): give it as remote_password (statekv serve: "
                "--remote-password-file or STATEKV_REMOTE_PASSWORD)"
            )
        extra = sorted(set(parsed) - {"host", "port", "username", "db", "connection_class"})
        if extra:
            raise ConfigError(field, f"{shown!r}: options {extra} are not supported")
        if parsed.get("db") not in (None, 0):
            raise ConfigError(
                field, f"{shown!r}: a Redis Cluster has only database 0; drop the path"
            )
        host, port = parsed.get("host"), parsed.get("port")
        if not host:
            raise ConfigError(field, f"{shown!r} names no host")
        if not isinstance(port, int) or not 1 <= port <= 65535 or f":{port}" not in text:
            raise ConfigError(field, f"{shown!r} must name a port in [1, 65535]")
        nodes.append(ClusterAddress(host=host, port=port))
        users.add(parsed.get("username") or None)
        schemes.add(scheme)
    if len(users) > 1 or len(schemes) > 1:
        raise ConfigError(field, "every node of one cluster takes the same scheme and user")
    return ClusterTarget(nodes=tuple(nodes), username=users.pop(), tls=schemes.pop() == "rediss")


def parse_cluster_url(url: object, *, field: str = "url") -> tuple[ClusterAddress, ...]:
    """The startup nodes of a cluster URL (:func:`parse_cluster`)."""
    return parse_cluster(url, field=field).nodes


def _without_password(text: str) -> str:
    scheme, _, rest = text.partition("://")
    _creds, at, host = rest.rpartition("@")
    return f"{scheme}://***@{host}" if at else text
