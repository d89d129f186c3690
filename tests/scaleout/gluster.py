"""A real distributed file system for the scale-out tests: GlusterFS in network namespaces.

Two GlusterFS servers and two client "nodes" run on this machine, each in a network namespace
of its own, joined by a bridge in a sixth namespace. The host's own network is never touched:
every address below exists only inside these namespaces.

```
 namespace   address       processes                                   role
 kvsg-sw     (bridge br0)  -                                           the switch
 kvsg-s1     10.99.0.1     glusterd, glusterfsd (brick <base>/s1/brick)  server 1
 kvsg-s2     10.99.0.2     glusterd, glusterfsd (brick <base>/s2/brick)  server 2
 kvsg-a      10.99.0.11    glusterfs FUSE client -> <base>/mnt/node-a    node A
 kvsg-b      10.99.0.12    glusterfs FUSE client -> <base>/mnt/node-b    node B
```

* The volume ``kvstore`` is a plain *distribute* volume over the two bricks (DHT: every file
  lives on one brick chosen by a hash of its name, so a rename across hash ranges leaves a
  link file; metadata operations cross the network). Bricks are directories on the local
  disk (``force``: gluster refuses bricks on the root file system otherwise). Volume options
  are GlusterFS 10's defaults (kvstore needs none) but ``cluster.min-free-disk``
  (:data:`VOLUME_OPTIONS`: the tests must not depend on the host disk's free space).
* Each glusterd runs in its server namespace through ``ip netns exec``, which also gives it a
  private mount namespace: ``/run/gluster`` and ``/var/log/glusterfs`` are bind-mounted to its
  own directories, its working directory and CLI socket are set in its own ``glusterd.vol``.
  The two glusterds are peers (``peer probe 10.99.0.2``). The ``gluster`` CLI talks to
  server 1 through its socket file (``--glusterd-sock``), from the host.
* Each FUSE client is started with ``nsenter --net`` (network namespace only): its traffic goes
  over its node's address, and the mount lands in the host's mount namespace, so it is visible
  to every process of this machine. Each mount is a separate FUSE superblock with its own
  kernel dentry/attribute/page caches and its own client-side translators (md-cache,
  write-behind, ...), so the two mounts behave towards each other like two machines. Node
  processes of the tests run under ``nsenter --net=<node namespace>`` as well (they need no
  network; it keeps each node's processes apart).
* Mount options: :data:`MOUNT_OPTIONS`; volume options: :data:`VOLUME_OPTIONS` (both
  documented in ``docs/shared-filesystems.md``). :func:`ensure_volume_options` sets the latter
  on an environment started before they were added (the clients reconfigure live).
* :func:`brick_files` lists what the bricks hold under a directory of the volume (data files
  and DHT link files): how many copies of a block really exist, whatever each client caches.

:func:`start` is idempotent (an environment already up and healthy is reused) and bounded in
time; :func:`stop` unmounts, stops the processes in these namespaces (by pid, from ``ip netns
pids``), deletes the namespaces and the base directory. :func:`set_metadata_delay` adds a fixed
delay to every brick LOOKUP/STAT (GlusterFS's debug/delay-gen), standing in for the network
round trip between machines in the benchmark. Faults (issue 35): :func:`frozen_brick`
SIGSTOPs one brick process (a hung server: connections stay open, nothing answers) and always
thaws it, :func:`ping_timeout` sets ``network.ping-timeout`` (how long clients wait for a hung
brick before they fail its calls) and restores it, :func:`brick_holding` says which brick holds
a file. ``python -m tests.scaleout.gluster
start|stop|status|delay USEC`` does the same for people (``scripts/gluster_env.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

BASE = Path(os.environ.get("KVSTORE_GLUSTER_BASE", "/srv/kvstore-gluster"))
VOLUME = "kvstore"
PREFIX = "kvsg-"
SWITCH = f"{PREFIX}sw"
SUBNET = "10.99.0"
SERVERS = (("s1", f"{SUBNET}.1"), ("s2", f"{SUBNET}.2"))
NODES = (("a", f"{SUBNET}.11"), ("b", f"{SUBNET}.12"))
# FUSE client options (seconds). entry/attribute: how long a client trusts a cached name or
# attributes (a block evicted elsewhere stays visible here that long: gc's grace period must
# exceed it). negative: how long a "no such file" is trusted (a block published on another
# node stays invisible here that long). 1 s each; GlusterFS's own default negative timeout
# is 0, the tests use 1 to check that the staleness stays bounded.
ENTRY_TIMEOUT_S = 1
ATTRIBUTE_TIMEOUT_S = 1
NEGATIVE_TIMEOUT_S = 1
MOUNT_OPTIONS = (
    f"--entry-timeout={ENTRY_TIMEOUT_S}",
    f"--attribute-timeout={ATTRIBUTE_TIMEOUT_S}",
    f"--negative-timeout={NEGATIVE_TIMEOUT_S}",
)
# GlusterFS's default cluster.rsync-hash-regex: DHT places ``.<name>.<suffix>`` on the brick
# that ``<name>`` hashes to. kvstore's temporary names have that shape
# (kvstore.store.paths.temp_path_for), so publishing with link(2) is one atomic link on
# one brick. A temporary name of another shape lands on another brick for about half the
# blocks, and DHT's cross-brick link is two steps that ignore the first step's EEXIST: two
# nodes publishing one block at once could both succeed (docs/shared-filesystems.md).
GLUSTER_RSYNC_HASH_REGEX = r"^\.(.+)\.[^.]+$"
# kvstore needs no volume option (O_DIRECT, which bricks can fail under load without
# network.remote-dio, is off by default on FUSE mounts: kvstore.io.host.probe_direct_io).
# The one set: cluster.min-free-disk. Below it (default 10 % free) DHT creates a new file on
# another brick than its name hashes to, with a link file on that one; both test bricks share
# the host's disk, so a host disk over 90 % full would move temporaries off their final name's
# brick and break what the tests check (one data file per block, no link file). Options listed
# here are set at start and on a reused environment; an option set by an earlier version of
# this module is reset to its default.
VOLUME_OPTIONS: tuple[tuple[str, str], ...] = (("cluster.min-free-disk", "0%"),)
# network.ping-timeout: set for the duration of a fault test (:func:`ping_timeout`); reset
# here too in case that test was killed before it could restore it.
RESET_OPTIONS = ("cluster.extra-hash-regex", "network.remote-dio", "network.ping-timeout")
APT_PACKAGES = ("glusterfs-server", "glusterfs-client")
TOOLS = ("glusterd", "glusterfs", "gluster", "ip", "nsenter", "mount", "umount")
COMMAND_TIMEOUT_S = 30
START_TIMEOUT_S = 90


class GlusterError(RuntimeError):
    """The environment could not be started (the message says which step and why)."""


@dataclass(frozen=True)
class Node:
    """One client machine: a network namespace and the FUSE mount its client made."""

    name: str  # "a", "b"
    netns: str
    address: str
    mount: Path

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]


@dataclass(frozen=True)
class GlusterEnv:
    """A running environment: the volume, its servers, and the two node mounts."""

    base: Path
    volume: str
    servers: tuple[tuple[str, str], ...]  # (namespace, address)
    nodes: tuple[Node, Node]
    mount_options: tuple[str, ...]
    local_dir: Path  # a directory on the disk under the bricks (benchmark baseline)

    @property
    def a(self) -> Node:
        return self.nodes[0]

    @property
    def b(self) -> Node:
        return self.nodes[1]

    def describe(self) -> str:
        servers = ", ".join(f"{ns} {addr}" for ns, addr in self.servers)
        nodes = ", ".join(f"node {n.name}: {n.netns} {n.address} -> {n.mount}" for n in self.nodes)
        return (
            f"GlusterFS volume {self.volume} (distribute, 2 bricks; servers {servers}); "
            f"{nodes}; mount options {' '.join(self.mount_options)}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "base": str(self.base),
            "volume": self.volume,
            "servers": [{"netns": ns, "address": a} for ns, a in self.servers],
            "nodes": [
                {"name": n.name, "netns": n.netns, "address": n.address, "mount": str(n.mount)}
                for n in self.nodes
            ],
            "mount_options": list(self.mount_options),
            "local_dir": str(self.local_dir),
        }


def environment(base: Path = BASE) -> GlusterEnv:
    """The description of the environment under ``base`` (whether running or not)."""
    nodes = tuple(
        Node(name, f"{PREFIX}{name}", address, base / "mnt" / f"node-{name}")
        for name, address in NODES
    )
    assert len(nodes) == 2
    return GlusterEnv(
        base=base,
        volume=VOLUME,
        servers=tuple((f"{PREFIX}{name}", address) for name, address in SERVERS),
        nodes=(nodes[0], nodes[1]),
        mount_options=MOUNT_OPTIONS,
        local_dir=base / "local",
    )


# -- prerequisites ---------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why this machine cannot run the environment, or None if it can (cheap checks)."""
    if not sys.platform.startswith("linux"):
        return f"GlusterFS environment needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "GlusterFS environment needs root (network namespaces, FUSE mounts)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (
            f"GlusterFS not installed (missing {', '.join(missing)}): "
            f"apt-get install -y {' '.join(APT_PACKAGES)}"
        )
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"FUSE not available: /dev/fuse: {exc}"
    os.close(fd)
    probe = f"{PREFIX}probe-{os.getpid()}"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        return f"network namespaces not permitted: ip netns add: {result.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


# -- start -----------------------------------------------------------------------------------


def start(base: Path = BASE, timeout_s: float = START_TIMEOUT_S) -> GlusterEnv:
    """Start the environment (or reuse a healthy running one); raises :class:`GlusterError`."""
    env = environment(base)
    if healthy(env):
        ensure_volume_options(env)
        return env
    reason = unavailable_reason()
    if reason is not None:
        raise GlusterError(reason)
    stop(base)  # whatever a crashed run left
    deadline = time.monotonic() + timeout_s
    try:
        _network(env)
        for name, address in SERVERS:
            _start_glusterd(env, name, address)
        for name, _ in SERVERS:
            sock = base / name / "glusterd.sock"
            _wait(sock.exists, deadline, f"glusterd of {name} ({sock})")
        _wait(lambda: _cli(env, "pool", "list", check=False).returncode == 0, deadline, "CLI")
        for _, address in SERVERS[1:]:
            _cli(env, "peer", "probe", address)
        _wait(lambda: _peers_connected(env), deadline, "peers connected")
        bricks = [f"{address}:{base / name / 'brick'}" for name, address in SERVERS]
        _cli(env, "volume", "create", VOLUME, "transport", "tcp", *bricks, "force")
        for key, value in VOLUME_OPTIONS:
            _cli(env, "volume", "set", VOLUME, key, value)
        _cli(env, "volume", "start", VOLUME)
        _wait(lambda: _bricks_online(env) == len(SERVERS), deadline, "bricks online")
        for node in env.nodes:
            _mount(env, node)
        for node in env.nodes:
            _wait(lambda n=node: _mounted(n.mount), deadline, f"the mount of node {node.name}")
        _check_shared(env, deadline)
        env.local_dir.mkdir(parents=True, exist_ok=True)
        (base / "env.json").write_text(json.dumps(env.to_json(), indent=1) + "\n")
    except BaseException as exc:
        logs = _log_tail(base)
        stop(base)
        if not isinstance(exc, Exception):
            raise
        raise GlusterError(f"{exc}{logs}") from exc
    return env


def _network(env: GlusterEnv) -> None:
    names = [SWITCH, *(ns for ns, _ in env.servers), *(n.netns for n in env.nodes)]
    for ns in names:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", SWITCH, "link", "set", "br0", "up"])
    peers = [*env.servers, *((n.netns, n.address) for n in env.nodes)]
    for i, (ns, address) in enumerate(peers):
        port = f"p{i}"
        _run(["ip", "-n", SWITCH, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns])
        _run(["ip", "-n", SWITCH, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])


def _start_glusterd(env: GlusterEnv, name: str, address: str) -> None:
    home = env.base / name
    for sub in ("lib", "run", "log", "brick"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    (home / "glusterd.vol").write_text(
        "volume management\n"
        "    type mgmt/glusterd\n"
        f"    option working-directory {home / 'lib'}\n"
        f"    option glusterd-sockfile {home / 'glusterd.sock'}\n"
        "    option transport-type socket\n"
        "    option transport.socket.listen-port 24007\n"
        f"    option transport.socket.bind-address {address}\n"
        "    option transport.socket.keepalive-time 10\n"
        "    option transport.socket.keepalive-interval 2\n"
        "    option transport.socket.read-fail-log off\n"
        "    option ping-timeout 0\n"
        "    option event-threads 1\n"
        "    option max-port 60999\n"
        "end-volume\n"
    )
    Path("/run/gluster").mkdir(parents=True, exist_ok=True)
    Path("/var/log/glusterfs").mkdir(parents=True, exist_ok=True)
    # ip netns exec gives the shell a private (slave) mount namespace: the bind mounts below
    # are seen by this glusterd and the brick processes it starts, nobody else.
    script = (
        f"mount --bind {home / 'run'} /run/gluster && "
        f"mount --bind {home / 'log'} /var/log/glusterfs && "
        f"exec glusterd -f {home / 'glusterd.vol'} -p {home / 'glusterd.pid'} "
        f"-l {home / 'log' / 'glusterd.log'}"
    )
    _run(["ip", "netns", "exec", f"{PREFIX}{name}", "sh", "-c", script])


def _cli(env: GlusterEnv, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    sock = env.base / SERVERS[0][0] / "glusterd.sock"
    argv = [
        "gluster",
        "--mode=script",
        f"--glusterd-sock={sock}",
        f"--log-file={env.base / 'cli.log'}",
        *args,
    ]
    return _run(argv, check=check)


def ensure_volume_options(env: GlusterEnv) -> None:
    """Set any of :data:`VOLUME_OPTIONS` the running volume lacks (clients pick them up live)."""
    changed = False
    for key, value in VOLUME_OPTIONS:
        if _volume_option(env, key) != value:
            _cli(env, "volume", "set", VOLUME, key, value)
            changed = True
    for key in RESET_OPTIONS:
        if key not in dict(VOLUME_OPTIONS) and _volume_option(env, key) not in ("", None):
            _cli(env, "volume", "reset", VOLUME, key, check=False)
            changed = True
    if changed:
        time.sleep(2)  # the clients fetch the new volfile and reconfigure


def _volume_option(env: GlusterEnv, key: str) -> str | None:
    """The volume's value of ``key`` when it was set explicitly, None when it is the default
    (``gluster volume info`` lists only reconfigured options)."""
    out = _cli(env, "volume", "info", VOLUME, check=False).stdout
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def brick_files(env: GlusterEnv, relative: str) -> dict[str, dict[str, int]]:
    """Regular files under ``relative`` (a directory of the volume) as the bricks hold them:
    per path, ``data`` (real copies, on any brick) and ``link`` (DHT link files, which point
    to the brick holding the data). Read from the bricks directly, bypassing every cache."""
    out: dict[str, dict[str, int]] = {}
    for name, _ in SERVERS:
        top = env.base / name / "brick" / relative
        for dirpath, _dirs, files in os.walk(top):
            for file in files:
                path = Path(dirpath) / file
                try:
                    if not stat.S_ISREG(path.lstat().st_mode):
                        continue
                except FileNotFoundError:
                    continue
                try:
                    os.getxattr(path, "trusted.glusterfs.dht.linkto", follow_symlinks=False)
                    kind = "link"
                except OSError:
                    kind = "data"
                counts = out.setdefault(str(path.relative_to(top)), {"data": 0, "link": 0})
                counts[kind] += 1
    return out


def _peers_connected(env: GlusterEnv) -> bool:
    out = _cli(env, "peer", "status", check=False).stdout
    return out.count("Peer in Cluster (Connected)") == len(SERVERS) - 1


def _bricks_online(env: GlusterEnv) -> int:
    out = _cli(env, "--xml", "volume", "status", VOLUME, check=False).stdout
    try:
        nodes = ElementTree.fromstring(out).iter("node")
    except ElementTree.ParseError:
        return 0
    return sum(1 for node in nodes if node.findtext("status") == "1")


def _mount(env: GlusterEnv, node: Node) -> None:
    node.mount.mkdir(parents=True, exist_ok=True)
    home = env.base / f"node-{node.name}"
    home.mkdir(parents=True, exist_ok=True)
    servers = [f"--volfile-server={address}" for _, address in env.servers]
    argv = [
        "glusterfs",
        *servers,
        f"--volfile-id={VOLUME}",
        f"--log-file={home / 'client.log'}",
        f"--pid-file={home / 'client.pid'}",
        *env.mount_options,
        str(node.mount),
    ]
    _run(node.command(argv))


def _mounted(path: Path) -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[4] == str(path) and fields[sep + 1] == "fuse.glusterfs":
                    return True
    except (OSError, ValueError):
        return False
    return False


def _check_shared(env: GlusterEnv, deadline: float) -> None:
    """A file written through node A's mount reads back through node B's, and a directory each
    node creates exists on every brick: both clients are connected to both bricks. (A client
    not yet reconnected to a brick still creates directories, on the bricks it reaches, with a
    hash layout that gives them every name: the files created under them all land there.)"""
    token = f"{os.getpid()}-{time.time_ns()}"
    probe_a = env.a.mount / f".kvsg-check-{token}"
    probe_b = env.b.mount / probe_a.name
    dirs = [f"{probe_a.name}.d", f"{probe_a.name}.e"]
    script = f"echo {token} > {probe_a} && cat {probe_b} && mkdir {probe_a}.d && mkdir {probe_b}.e"
    while True:
        ok = _timed(["sh", "-c", script], 10)
        on_every_brick = all(
            (env.base / name / "brick" / d).is_dir() for name, _ in SERVERS for d in dirs
        )
        _timed(["rm", "-rf", str(probe_a), f"{probe_a}.d", f"{probe_b}.e"], 10)
        if ok is not None and ok.strip() == token and on_every_brick:
            return
        if time.monotonic() > deadline:
            raise GlusterError("the two nodes do not share the volume (or a brick is down)")
        time.sleep(0.2)


def set_metadata_delay(env: GlusterEnv, usec: int, timeout_s: float = 60) -> None:
    """Delay every LOOKUP and STAT on the bricks by ``usec`` microseconds (0: none).

    GlusterFS's debug/delay-gen translator, below each brick: it stands in for the network
    round trip to a server on another machine, which a single machine lacks (veth pairs answer
    in microseconds). The bricks restart to load it; the FUSE clients reconnect by themselves.
    """
    if usec:
        for key, value in (
            ("debug.delay-gen", "posix"),
            ("delay-gen.delay-percentage", "100"),
            ("delay-gen.delay-duration", str(usec)),
            ("delay-gen.enable", "lookup,stat"),
        ):
            _cli(env, "volume", "set", VOLUME, key, value)
    else:
        for key in ("debug.delay-gen", "delay-gen.delay-duration", "delay-gen.enable"):
            _cli(env, "volume", "reset", VOLUME, key, check=False)
    restart_volume(env, timeout_s)


def restart_volume(env: GlusterEnv, timeout_s: float = 60) -> None:
    """Stop and start the volume (its brick processes; a few seconds) and wait until both
    nodes share it again: the FUSE clients reconnect by themselves, with fresh connections."""
    _cli(env, "volume", "stop", VOLUME)
    _cli(env, "volume", "start", VOLUME)
    deadline = time.monotonic() + timeout_s
    _wait(lambda: _bricks_online(env) == len(SERVERS), deadline, "bricks online")
    _check_shared(env, deadline)


# -- faults: a hung brick --------------------------------------------------------------------

PING_TIMEOUT = "network.ping-timeout"
DEFAULT_PING_TIMEOUT_S = 42  # GlusterFS's value when the volume does not set it
SIGNAL_TIMEOUT_S = 10  # for every thread of a brick process to stop, or to run again


def brick_holding(env: GlusterEnv, relative: str | Path) -> str | None:
    """Which server's brick ("s1", "s2") holds the data of the file ``relative`` (a path in the
    volume, e.g. relative to a mount), None when no brick does. A DHT link file is not data:
    it only points to the brick that holds it."""
    for name, _ in SERVERS:
        path = env.base / name / "brick" / relative
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                continue
            os.getxattr(path, "trusted.glusterfs.dht.linkto", follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            return name  # no linkto attribute: the data itself
    return None


def brick_pid(env: GlusterEnv, which: str) -> int:
    """The pid of the brick process (``glusterfsd``) of server ``which`` ("s1", "s2").

    Found among the processes of the server's network namespace by its command line
    (``--brick-name <base>/<which>/brick``), not through ``gluster volume status``: glusterd
    asks the bricks for that, and a frozen brick never answers.
    """
    if which not in dict(SERVERS):
        raise GlusterError(f"no server {which!r}: expected one of {[n for n, _ in SERVERS]}")
    brick = str(env.base / which / "brick")
    found = []
    for pid in _netns_pids(f"{PREFIX}{which}"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # exited meanwhile
        if Path(argv[0]).name == "glusterfsd" and _option(argv, "--brick-name") == brick:
            found.append(pid)
    if len(found) != 1:
        raise GlusterError(f"expected one glusterfsd for brick {brick}, found pids {found}")
    return found[0]


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (``--name value``), None when absent."""
    for i, arg in enumerate(argv[:-1]):
        if arg == name:
            return argv[i + 1]
    return None


def _thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``T``: stopped); [] once it is gone."""
    states = []
    for stat_file in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError, IndexError):
            states.append(stat_file.read_text().rpartition(") ")[2][:1])
    return states


def freeze_brick(env: GlusterEnv, which: str) -> int:
    """SIGSTOP the brick process of server ``which``; returns its pid once every one of its
    threads is stopped. Its TCP connections stay open and the kernel still accepts new ones,
    so clients see a hung server, not a dead one, until ``network.ping-timeout`` passes.
    Always pair with :func:`thaw_brick` (or use :func:`frozen_brick`)."""
    pid = brick_pid(env, which)
    os.kill(pid, signal.SIGSTOP)
    _wait(
        lambda: all(s == "T" for s in _thread_states(pid)),
        time.monotonic() + SIGNAL_TIMEOUT_S,
        f"every thread of brick process {pid} ({which}) stopped",
    )
    return pid


def thaw_brick(env: GlusterEnv, which: str | None = None, pid: int | None = None) -> None:
    """SIGCONT the brick process of server ``which`` (or the process ``pid``: the one that
    was frozen, found again without asking anything of the volume); waits until none of its
    threads is stopped. A process that is gone is no error."""
    if pid is None:
        if which is None:
            raise ValueError("thaw_brick: give which or pid")
        pid = brick_pid(env, which)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    _wait(
        lambda: "T" not in _thread_states(pid),
        time.monotonic() + SIGNAL_TIMEOUT_S,
        f"brick process {pid} running again",
    )


@contextlib.contextmanager
def frozen_brick(env: GlusterEnv, which: str) -> Iterator[int]:
    """The brick of server ``which`` frozen (SIGSTOP) inside the block, its pid yielded; thawed
    on every exit, an exception included: a process blocked in I/O to a stopped brick may
    not even be killable until the brick answers (or ping-timeout passes)."""
    pid = freeze_brick(env, which)
    try:
        yield pid
    finally:
        thaw_brick(env, pid=pid)


def ping_timeout_s(env: GlusterEnv) -> int:
    """The volume's ``network.ping-timeout`` in seconds (GlusterFS's default when unset)."""
    value = _volume_option(env, PING_TIMEOUT)
    return int(value) if value else DEFAULT_PING_TIMEOUT_S


def set_ping_timeout(
    env: GlusterEnv, seconds: int | None, timeout_s: float = 60, *, fresh: bool = True
) -> None:
    """Set ``network.ping-timeout`` (None: reset it to GlusterFS's default, 42 s) and wait until
    both FUSE clients use it (each logs ``changing ping timeout to N`` per brick connection).

    The ping timeout is how long a client waits for an answer from a brick, once it has calls
    outstanding there, before it disconnects from it and fails those calls: it pings the brick
    when a call is sent on an idle connection and every timeout while calls are outstanding,
    and gives up when a ping timer expires with nothing received for the whole timeout. A
    client applies a new value to the timers it arms from then on; a timer already armed (up
    to the old value) still runs its course first. ``fresh`` (the default) therefore restarts
    the volume (:func:`restart_volume`): on their new connections the clients use the new
    value at once.
    """
    target = DEFAULT_PING_TIMEOUT_S if seconds is None else seconds
    if seconds is not None and not 0 < seconds <= 1013:  # GlusterFS's accepted range
        raise ValueError(f"ping-timeout: expected 1..1013 seconds, got {seconds}")
    unchanged = ping_timeout_s(env) == target
    logs = [env.base / f"node-{node.name}" / "client.log" for node in env.nodes]
    offsets = [log.stat().st_size if log.exists() else 0 for log in logs]
    if seconds is None:
        _cli(env, "volume", "reset", VOLUME, PING_TIMEOUT)
    else:
        _cli(env, "volume", "set", VOLUME, PING_TIMEOUT, str(seconds))
    deadline = time.monotonic() + timeout_s
    line = f"changing ping timeout to {target} "
    for log, offset in zip(logs, offsets, strict=True):
        if unchanged:
            break  # the clients reconfigure nothing and log nothing
        _wait(
            lambda log=log, offset=offset: _log_since(log, offset).count(line) >= len(SERVERS),
            deadline,
            f"{log}: {line.strip()}",
        )
    if fresh:
        restart_volume(env, max(1.0, deadline - time.monotonic()))


def _log_since(log: Path, offset: int) -> str:
    """What ``log`` gained after byte ``offset``."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@contextlib.contextmanager
def ping_timeout(env: GlusterEnv, seconds: int) -> Iterator[None]:
    """``network.ping-timeout`` set to ``seconds`` inside the block, fresh connections included
    (:func:`set_ping_timeout`), then back to what it was (the default when it was not set),
    on every exit. Open files on the volume across the restart are better avoided: enter
    this before the store is opened."""
    before = _volume_option(env, PING_TIMEOUT)
    set_ping_timeout(env, seconds)
    try:
        yield
    finally:
        # No restart: the timers left armed with the shorter value only make a client give
        # up sooner, and only until they next expire.
        set_ping_timeout(env, int(before) if before else None, fresh=False)


def wait_readable(paths: Sequence[Path], timeout_s: float) -> float:
    """Wait until every file of ``paths`` reads whole (each try in a child process, bounded:
    a read that hangs blocks the child, not the caller). Returns the seconds it took;
    raises :class:`GlusterError` past ``timeout_s``."""
    started = time.monotonic()
    argv = ["sh", "-c", 'cat "$@" > /dev/null', "sh", *map(str, paths)]
    _wait(
        lambda: _timed(argv, max(1.0, timeout_s / 4)) is not None,
        started + timeout_s,
        f"{len(paths)} files readable",
    )
    return time.monotonic() - started


# -- health and stop -------------------------------------------------------------------------


def healthy(env: GlusterEnv) -> bool:
    """Both mounts are up and answer within a few seconds (a hung FUSE mount is not healthy)."""
    if not all(_mounted(n.mount) for n in env.nodes):
        return False
    return all(_timed(["stat", "-f", str(n.mount)], 5) is not None for n in env.nodes)


def stop(base: Path = BASE, *, keep_data: bool = False) -> None:
    """Tear everything down: mounts, processes in our namespaces, namespaces, files."""
    env = environment(base)
    for node in env.nodes:
        if _mounted(node.mount) and _run(["umount", str(node.mount)], check=False).returncode:
            _run(["umount", "-l", str(node.mount)], check=False)  # busy: detach it now
    ours = [SWITCH, *(ns for ns, _ in env.servers), *(n.netns for n in env.nodes)]
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    ours = [ns for ns in ours if ns in existing]
    pids = [pid for ns in ours for pid in _netns_pids(ns)]
    _signal_all(pids, signal.SIGTERM)
    _signal_all(pids, signal.SIGCONT)  # a brick left frozen by a killed fault test
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    _signal_all(pids, signal.SIGKILL)
    for ns in ours:
        _run(["ip", "netns", "del", ns], check=False)
    if not keep_data and base.exists():
        for node in env.nodes:  # never delete through a mount that is somehow still there
            if _mounted(node.mount):
                raise GlusterError(f"{node.mount} is still mounted; not deleting {base}")
        shutil.rmtree(base, ignore_errors=True)


def _netns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


# -- small helpers ---------------------------------------------------------------------------


def _run(
    argv: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise GlusterError(f"{' '.join(argv)}: no answer in {timeout:.0f} s") from exc
    if check and result.returncode != 0:
        said = (result.stderr or result.stdout).strip()
        raise GlusterError(f"{' '.join(argv)}: exit {result.returncode}: {said}")
    return result


def _timed(argv: Sequence[str], timeout: float) -> str | None:
    """stdout of ``argv`` if it succeeds within ``timeout`` (in a child: a hung FUSE call
    blocks the child, not this process), else None."""
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return None
    return result.stdout if result.returncode == 0 else None


def _wait(predicate: object, deadline: float, what: str) -> None:
    assert callable(predicate)
    while not predicate():
        if time.monotonic() > deadline:
            raise GlusterError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _log_tail(base: Path, lines: int = 5) -> str:
    parts = []
    for log in sorted(base.glob("*/log/glusterd.log")) + sorted(base.glob("node-*/client.log")):
        with contextlib.suppress(OSError):
            errors = [ln for ln in log.read_text().splitlines() if "] E [" in ln]
            if errors:
                parts.append(f"\n  {log}: " + "\n    ".join(errors[-lines:]))
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.scaleout.gluster", description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "status", "delay"])
    parser.add_argument("usec", nargs="?", type=int, default=0, help="delay: microseconds")
    parser.add_argument("--base", type=Path, default=BASE, help=f"state directory ({BASE})")
    parser.add_argument("--json", action="store_true", help="print the environment as JSON")
    args = parser.parse_args(argv)
    env = environment(args.base)
    if args.action == "stop":
        stop(args.base)
        print(f"stopped; removed {args.base}")
        return 0
    if args.action == "delay":
        if not healthy(env):
            print("not running", file=sys.stderr)
            return 1
        set_metadata_delay(env, args.usec)
        print(f"brick LOOKUP/STAT delay: {args.usec} us")
        return 0
    if args.action == "start":
        try:
            env = start(args.base)
        except GlusterError as exc:
            print(f"gluster environment: {exc}", file=sys.stderr)
            return 1
    elif not healthy(env):
        print("not running", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(env.to_json(), indent=1))
    else:
        print(env.describe())
        for node in env.nodes:
            print(
                f"node {node.name}: {node.mount}  (run node processes with: "
                f"{' '.join(node.command(['<command>']))})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
