"""A real three-master Redis Cluster on loopback ports, for the shared tier's tests and bench.

Debian's ``redis-server`` and ``redis-cli`` run it (.ci/run installs them): each master is a
``redis-server --cluster-enabled yes`` in its own directory under a temporary folder, and
``redis-cli --cluster create ... --cluster-replicas 0`` assigns the 16384 hash slots.

Settings and why:

- ``cluster-require-full-coverage no``: when one master dies the others go on serving their
  slots (the shared tier loses only the blocks on the dead node);
- ``cluster-node-timeout`` short, so that the survivors mark a killed node failed quickly;
- no persistence (``save ""``, no AOF): the tier is a cache, and a test must not leave
  files behind or wait on fsync;
- ``maxmemory-policy allkeys-lru``: what a deployment of the shared tier should run, so that
  a full cluster evicts old blocks instead of refusing new ones.

The tests reach it through tests/redis_cluster.py, which fails (with ``CI`` set) or skips
a test on a machine without redis-server; bench.remote starts one for its run.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from io_actors.storage.remote_faults import owns_slot

CLUSTER_BUS_OFFSET = 10000
"""Redis Cluster's node-to-node bus listens on the client port plus this."""
START_TIMEOUT_S = 30.0


def die_with_parent() -> list[str]:
    """A command prefix under which the kernel sends a server SIGTERM when the thread that
    started it dies, so that a cluster never outlives a process killed without running its
    clean-up (a test session that mutmut's CPU limit ends with SIGXCPU, a kill -9): util-linux's
    ``setpriv --pdeathsig`` (Debian's essential set), which execs the server with the
    setting kept; no prefix where it is missing."""
    setpriv = shutil.which("setpriv")
    return [] if setpriv is None else [setpriv, "--pdeathsig", "TERM", "--"]


def find_redis_tools() -> tuple[str, str] | None:
    """Paths of redis-server and redis-cli, or None when either is missing."""
    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, taken: set[int] | None = None) -> list[int]:
    """`count` loopback ports whose cluster-bus ports (+10000) are free too."""
    taken = set() if taken is None else taken
    found: list[int] = []
    while len(found) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + CLUSTER_BUS_OFFSET > 65535 or port in taken or port in found:
            continue
        if _port_free(port + CLUSTER_BUS_OFFSET):
            found.append(port)
    return found


@attrs.define
class RedisNode:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalRedisCluster:
    """Masters on loopback, started by :meth:`start` and stopped by :meth:`stop`."""

    def __init__(self, directory: Path, *, masters: int = 3, node_timeout_ms: int = 1000,
                 maxmemory: str = "256mb", password: str | None = None) -> None:
        tools = find_redis_tools()
        if tools is None:
            raise RuntimeError("redis-server / redis-cli not found: apt-get install -y "
                               "redis-server")
        self.server, self.cli = tools
        self.directory = directory
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.maxmemory = maxmemory
        self.password = password
        """With a password every node requires AUTH (``requirepass``, the default user)."""
        self.nodes: list[RedisNode] = []

    def _auth(self) -> list[str]:
        # REDISCLI_AUTH would keep it off the command line; these are throwaway test nodes.
        return [] if self.password is None else ["-a", self.password, "--no-auth-warning"]

    @property
    def url(self) -> str:
        """Every master, the form a replica's config takes (redis-py needs only one)."""
        return ",".join(f"redis://{n.address}" for n in self.nodes)

    def _cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        done = subprocess.run(
            [self.cli, "-h", "127.0.0.1", "-p", str(port), *self._auth(), *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def command(self, node: RedisNode, *args: str) -> str:
        """One redis-cli command against one node (administration in tests)."""
        return self._cli(node.port, *args)

    def _spawn(self, node: RedisNode) -> None:
        node.directory.mkdir(parents=True, exist_ok=True)
        log = (node.directory / "redis.log").open("ab")
        node.process = subprocess.Popen(
            [
                *die_with_parent(),
                self.server, "--port", str(node.port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no",
                "--dir", str(node.directory), "--save", "", "--appendonly", "no",
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--daemonize", "no",
                *([] if self.password is None else ["--requirepass", self.password,
                                                    "--masterauth", self.password]),
            ],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()

    def _wait_ping(self, node: RedisNode, deadline: float) -> None:
        while True:
            if not node.alive:
                log = (node.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on {node.port} exited:\n{log}")
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if self._cli(node.port, "ping", timeout=2).strip() == "PONG":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {node.port} did not answer")
            time.sleep(0.05)

    def start(self) -> LocalRedisCluster:
        deadline = time.monotonic() + START_TIMEOUT_S
        ports = free_ports(self.masters)
        self.nodes = [RedisNode(port=p, directory=self.directory / str(p)) for p in ports]
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_ping(node, deadline)
            subprocess.run(
                [self.cli, *self._auth(), "--cluster", "create",
                 *(n.address for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=START_TIMEOUT_S, check=True,
            )
            self.wait_ok(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def cluster_info(self, node: RedisNode) -> dict[str, str]:
        out = self._cli(node.port, "cluster", "info")
        return dict(line.split(":", 1) for line in out.split() if ":" in line)

    def wait_ok(self, deadline: float | None = None) -> None:
        """Until every live master says the cluster is OK and knows every slot's owner."""
        deadline = time.monotonic() + START_TIMEOUT_S if deadline is None else deadline
        while True:
            live = [n for n in self.nodes if n.alive]
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                infos = [self.cluster_info(n) for n in live]
                if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_assigned")
                       == "16384" and i.get("cluster_known_nodes") == str(len(self.nodes))
                       for i in infos):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not OK in time: {[n.port for n in live]}")
            time.sleep(0.05)

    def node_for(self, key: bytes) -> RedisNode:
        """The live master that owns `key`'s hash slot, by its own account."""
        slot = int(self._cli(self.nodes[0].port if self.nodes[0].alive else
                             next(n for n in self.nodes if n.alive).port,
                             "cluster", "keyslot", key.decode()).strip())
        for node in self.nodes:
            if not node.alive:
                continue
            for line in self._cli(node.port, "cluster", "nodes").splitlines():
                fields = line.split()
                if len(fields) > 2 and "myself" in fields[2].split(","):
                    if owns_slot(fields[8:], slot):
                        return node
                    break
        raise RuntimeError(f"no live master owns slot {slot}")

    def kill(self, node: RedisNode) -> None:
        """SIGKILL one master (a crash: no goodbye to the cluster or the clients)."""
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=10)


@contextlib.contextmanager
def running_cluster(directory: Path, *, masters: int = 3,
                    maxmemory: str = "256mb") -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster(directory, masters=masters, maxmemory=maxmemory)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
