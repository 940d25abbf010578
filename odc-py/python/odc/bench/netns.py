"""Hosts emulated by Linux network namespaces, and benchmark ranks spread across them.

:class:`Namespaces` creates N network namespaces on this machine, each with
its loopback up and one veth whose other end is a port of a bridge in the
root namespace::

    root namespace:  bridge <prefix>b 10.231.X.1/24  (the rendezvous store listens here)
                       ├── <prefix>r0 ══ veth ══ <prefix>v0 10.231.X.10  namespace <prefix>n0
                       └── <prefix>r1 ══ veth ══ <prefix>v1 10.231.X.11  namespace <prefix>n1

Traffic between namespaces crosses the kernel's TCP stack and the bridge,
like traffic between hosts (there is no shared loopback). With ``rate``
(``"1gbit"``, ``"10gbit"``: ``tc``'s units) both ends of every veth are
shaped by a token-bucket filter (``tc qdisc ... tbf``), so each namespace's
link carries at most that rate each way, as a NIC would; shared memory is
still shared, so only a transport that uses the network is exercised by a
peer in another namespace. ``<prefix>`` is ``odc<pid><letter>``, so sets of
concurrent processes never collide, and ``X`` is derived from the pid and
moved on while the subnet is in use. Sets left behind by a crashed process
(its pid gone) are removed before a new set is made. Needs root and
``ip`` (iproute2).

:func:`run_ranks` runs a benchmark's rank function on ``world`` local
processes placed ``world / netns`` per namespace (rank ``r`` in namespace
``r // (world / netns)``): each spawned rank enters its namespace before it
opens a socket, connects to the store on the bridge address, and runs with
``LOCAL_WORLD_SIZE``, ``ODC_FABRIC_ADDR``, ``GLOO_SOCKET_IFNAME`` and
``ODC_TRANSPORT`` set for its namespace, so the collective baseline (gloo)
and ODC cross the same links.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Namespaces",
    "NetnsError",
    "enter",
    "rank_placement",
    "rate_bits",
    "run_ranks",
    "unavailable_reason",
    "veth_bytes",
]

CLONE_NEWNET = 0x40000000
_PREFIX_RE = re.compile(r"^odc(\d+)([a-z])[nrvb]\d*$")
_sequence = itertools.count()  # distinguishes the prefixes of one process's namespace sets


class NetnsError(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip_binary() -> str | None:
    fallbacks = ("/usr/sbin/ip", "/sbin/ip", "/bin/ip")
    return shutil.which("ip") or next((p for p in fallbacks if os.access(p, os.X_OK)), None)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None when they may be."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if _ip_binary() is None:
        return "the `ip` command (iproute2) is missing"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = _ip_binary() or "ip"
    p = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"1gbit"`` or ``"500mbit"``.

    Raises:
        ValueError: not a rate of that form.
    """
    m = _RATE_RE.match(rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected <number>[k|m|g]bit, e.g. 1gbit")
    return float(m.group(1)) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def veth_bytes(ifname: str) -> tuple[int, int]:
    """Bytes received and sent by interface ``ifname`` as the calling thread's network namespace sees it
    (``/proc/self/net/dev``): a rank that :func:`enter` put in its namespace reads its own veth.

    Raises:
        RuntimeError: no such interface there.
    """
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                cols = rest.split()
                return int(cols[0]), int(cols[8])
    raise RuntimeError(f"no interface {ifname!r} in /proc/self/net/dev")


def _shape(rate: str, dev: str, ns: str | None = None) -> None:
    """A token-bucket filter of ``rate`` on ``dev``'s egress (inside ``ns``, or in this namespace)."""
    tc = shutil.which("tc") or "/usr/sbin/tc"
    # The bucket holds 4 ms of the rate, and at least 1 MiB: veths hand the
    # qdisc segments of up to 64 KiB (GSO), which a smaller bucket drops.
    burst = max(int(rate_bits(rate) / 8 / 250), 1 << 20)
    cmd = [tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    if ns is not None:
        cmd = [_ip_binary() or "ip", "netns", "exec", ns, *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if p.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing() -> tuple[list[str], list[str]]:
    """Names of every namespace and every root-namespace link made by this module (any process)."""
    names = [line.split()[0] for line in _run("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = []
    for line in _run("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            links.append(parts[1].strip().split("@")[0])
    ours = re.compile(r"^odc\d+[a-z]")
    return [n for n in names if ours.match(n)], [link for link in links if ours.match(link)]


def _remove(namespaces: list[str], links: list[str]) -> list[str]:
    """Deletes namespaces and links, best effort; returns what could not be removed."""
    failed = []
    for link in links:  # veth root ends first (deleting one end removes the pair), the bridge last
        p = _run("link", "del", link, check=False)
        if p.returncode != 0 and "Cannot find device" not in p.stderr:
            failed.append(f"link {link}: {p.stderr.strip()}")
    for ns in namespaces:
        p = _run("netns", "del", ns, check=False)
        if p.returncode != 0 and "No such file" not in p.stderr:
            failed.append(f"netns {ns}: {p.stderr.strip()}")
    return failed


def _sweep_stale(own_prefix: str) -> None:
    """Removes sets whose creating process is gone, and any earlier set with our own prefix."""
    namespaces, links = _existing()

    def stale(name: str) -> bool:
        if name.startswith(own_prefix):
            return True
        m = _PREFIX_RE.match(name)
        return m is not None and not _pid_alive(int(m.group(1)))

    bridges_last = sorted((link for link in links if stale(link)), key=lambda link: link.endswith("b"))
    _remove([n for n in namespaces if stale(n)], bridges_last)


def _used_subnets() -> set[int]:
    used = set()
    for m in re.finditer(r"inet 10\.231\.(\d+)\.", _run("-4", "-o", "addr", "show", check=False).stdout):
        used.add(int(m.group(1)))
    for m in re.finditer(r"^10\.231\.(\d+)\.", _run("-4", "route", "show", check=False).stdout, re.M):
        used.add(int(m.group(1)))
    return used


@dataclass
class Namespaces:
    """N network namespaces joined by a bridge in the root namespace (see the module doc).

    Use as a context manager; :meth:`close` (also run on ``__exit__``)
    removes everything, whatever happened inside.

    Attributes:
        n: number of namespaces.
        names: namespace names (``ip netns exec NAME ...``).
        addrs: each namespace's address on the bridge subnet.
        ifnames: each namespace's veth (its name inside the namespace).
        root_links: the root-namespace end of each namespace's veth (take it
            down to cut that namespace off).
        bridge, root_addr: the bridge and its address (the store's host).
        rate: the token-bucket rate each veth end is shaped to (``tc``'s
            units, ``"1gbit"``), or ``""`` for none.
        rates: per namespace, its veth's rate instead of ``rate`` (``""``:
            unshaped); empty: ``rate`` for every namespace.
    """

    n: int
    prefix: str = ""
    names: list[str] = field(default_factory=list)
    addrs: list[str] = field(default_factory=list)
    ifnames: list[str] = field(default_factory=list)
    root_links: list[str] = field(default_factory=list)
    bridge: str = ""
    root_addr: str = ""
    rate: str = ""
    rates: list[str] = field(default_factory=list)
    _created: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 9:
            raise ValueError(f"namespaces: need 1 to 9, got {self.n}")
        if not self.prefix:
            self.prefix = f"odc{os.getpid()}{chr(ord('a') + next(_sequence) % 26)}"
        if self.rates and len(self.rates) != self.n:
            raise ValueError(f"namespaces: {len(self.rates)} rates for {self.n} namespaces")

    def create(self) -> Namespaces:
        """Makes the namespaces, veths and bridge; raises :class:`NetnsError` (after cleaning up) on failure."""
        why = unavailable_reason()
        if why is not None:
            raise NetnsError(why)
        _sweep_stale(self.prefix)
        used = _used_subnets()
        x = next((c for c in ((os.getpid() + i) % 200 + 20 for i in range(200)) if c not in used), None)
        if x is None:
            raise NetnsError("no free 10.231.X.0/24 subnet")
        p = self.prefix
        self.bridge, self.root_addr = f"{p}b", f"10.231.{x}.1"
        self.names = [f"{p}n{i}" for i in range(self.n)]
        self.root_links = [f"{p}r{i}" for i in range(self.n)]
        self.ifnames = [f"{p}v{i}" for i in range(self.n)]
        self.addrs = [f"10.231.{x}.{10 + i}" for i in range(self.n)]
        self._created = True
        try:
            _run("link", "add", self.bridge, "type", "bridge")
            _run("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
            _run("link", "set", self.bridge, "up")
            rates = self.rates or [self.rate] * self.n
            for ns, root, inner, addr, rate in zip(self.names, self.root_links, self.ifnames, self.addrs, rates,
                                                   strict=True):
                _run("netns", "add", ns)
                _run("-n", ns, "link", "set", "lo", "up")
                _run("link", "add", root, "type", "veth", "peer", "name", inner, "netns", ns)
                _run("link", "set", root, "master", self.bridge)
                _run("link", "set", root, "up")
                _run("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                _run("-n", ns, "link", "set", inner, "up")
                if rate:
                    _shape(rate, root)
                    _shape(rate, inner, ns)
        except BaseException:
            with contextlib.suppress(NetnsError):
                self.close()  # best effort: the creation error is the one to report
            raise
        return self

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside namespace ``i``."""
        return [_ip_binary() or "ip", "netns", "exec", self.names[i]]

    def set_link(self, i: int, up: bool) -> None:
        """Takes namespace ``i``'s link up or down (its root-side veth end)."""
        _run("link", "set", self.root_links[i], "up" if up else "down")

    def close(self) -> None:
        """Removes the namespaces, veths and bridge (idempotent). Processes inside must be gone first."""
        if not self._created:
            return
        self._created = False
        failed = _remove(list(self.names), [*self.root_links, self.bridge])
        if failed:
            raise NetnsError("could not remove: " + "; ".join(failed))

    def __enter__(self) -> Namespaces:
        return self.create() if not self._created else self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def enter(name: str) -> None:
    """Moves the calling thread (and every thread it starts later) into namespace ``name``.

    Call it before the process opens a socket or starts a thread.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def rank_placement(ns: Namespaces, world: int, transport: str) -> list[tuple[str, dict[str, str]]]:
    """``(namespace, environment)`` of every rank: ``world / ns.n`` consecutive ranks per namespace."""
    if world % ns.n != 0:
        raise ValueError(f"{world} ranks do not split evenly over {ns.n} namespaces")
    per = world // ns.n
    out = []
    for r in range(world):
        i = r // per
        out.append((ns.names[i], {
            "LOCAL_WORLD_SIZE": str(per),
            "LOCAL_RANK": str(r % per),
            "ODC_FABRIC_ADDR": ns.addrs[i],
            "GLOO_SOCKET_IFNAME": ns.ifnames[i],
            "ODC_TRANSPORT": transport,
        }))
    return out


def run_ranks(fn: Any, world: int, *, netns: int, transport: str, backend: str, rate: str = "",
              **kwargs: Any) -> Any:
    """:func:`odc.bench.launch.run_ranks` with the ranks spread over ``netns`` fresh namespaces.

    ``rate`` shapes every namespace's link (see :class:`Namespaces`).

    Raises:
        NetnsError: the namespaces could not be made.
        BenchError: a rank failed (as the local launcher).
    """
    from . import launch

    with Namespaces(netns, rate=rate) as ns:
        return launch.run_ranks(fn, world, backend=backend, placement=rank_placement(ns, world, transport),
                                store_host=ns.root_addr, **kwargs)
