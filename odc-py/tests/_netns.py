"""Ranks on emulated hosts: network namespaces joined by a bridge, one process per rank.

:func:`cluster` (a context manager) makes ``hosts`` namespaces with
:class:`odc.bench.netns.Namespaces` (loopback up, a veth to a bridge in the
root namespace, addresses from a private /24), hosts a ``TCPStore`` in this
process on the bridge address, and starts every rank as a fork of the tests'
fork server (``_dist``: torch and odc imported once) that enters its namespace
(``setns``) and runs ``_multihost_worker.run(<folder>, <steps>)``
(``ODC_TEST_SPAWN=1``: as
``ip netns exec <namespace> <python> _multihost_worker.py <folder> <steps>``, a new
interpreter per rank), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` /
``MASTER_PORT``, ``ODC_FABRIC_ADDR`` (its namespace's address),
``GLOO_SOCKET_IFNAME`` (its veth), ``ODC_JOB_KEY`` and ``ODC_TIMEOUT_S``.
Consecutive ranks share a namespace (a "node").

Every rank has a deadline and is killed when the block exits, whatever
happened; the namespaces, veths and bridge are removed after that. When
namespaces cannot be made here (not root, no ``ip``, creation refused) the
test is skipped with the reason, or fails under ``ODC_REQUIRE_NETNS=1``.

Ranks report through files in a per-test folder (the file system is shared
by every namespace): ``rank<r>.s<step>.json`` with each step's outcome, ``rank<r>.err`` with
stderr, ``ready-<r>`` / ``go`` for tests that act on the network mid-run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _dist
import pytest

from odc.bench.netns import Namespaces, NetnsError, enter, unavailable_reason

WORKER = Path(__file__).resolve().with_name("_multihost_worker.py")


@dataclass
class Outcome:
    """What one rank reported: ``status`` is ok / error / unavailable, or silent (exited without a
    report) / hung (killed at the deadline)."""

    rank: int
    status: str
    value: Any = None
    error_type: str = ""
    message: str = ""
    peer: int | None = None
    elapsed: float | None = None
    stderr: str = ""
    returncode: int | None = None

    def describe(self) -> str:
        head = f"rank {self.rank}: {self.status}"
        if self.status == "error":
            head += f" {self.error_type}: {self.message}"
        tail = self.stderr.strip().splitlines()[-25:]
        return head + f" (exit code {self.returncode})" + ("\n    " + "\n    ".join(tail) if tail else "")


def _forked_rank(namespace: str, env: dict[str, str], err_path: str, folder: str, steps: list[Any]) -> None:
    """One rank, forked from the tests' fork server (which imported torch and odc once): what
    ``ip netns exec <namespace>`` gives a new interpreter (the namespace's network, the rank's environment, its
    output in ``err_path``), then ``_multihost_worker.run``. The namespace is entered before any socket opens."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _dist.adopt(env, fd, fd)
    os.close(fd)
    enter(namespace)
    import _multihost_worker as worker
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # torch read OMP_NUM_THREADS in the server
    worker.STARTED = time.monotonic()
    worker.run(Path(folder), steps)
    sys.stdout.flush()
    sys.stderr.flush()


class _Forked:
    """A forked rank behind the part of ``subprocess.Popen`` :class:`Cluster` uses."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.proc.name, timeout or 0.0)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


@dataclass
class Cluster:
    """``hosts`` namespaces with ``per_host`` ranks each; see the module doc."""

    ns: Namespaces
    per_host: int
    folder: Path
    store: Any
    procs: dict[int, Any] = field(default_factory=dict)  # subprocess.Popen or _Forked
    killed: set[int] = field(default_factory=set)

    @property
    def world(self) -> int:
        return self.ns.n * self.per_host

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    def start(self, steps: list[tuple[str, dict]], *, timeout_s: float = 30.0,
              env: dict[str, str] | None = None) -> None:
        """Starts every rank, running ``steps``: ``(scenario, params)`` of ``_multihost_worker``, in order.

        ``timeout_s`` is the engines' deadline (``ODC_TIMEOUT_S``); ``env``
        is added to every rank's environment.
        """
        job = f"mh{os.getpid()}-{self.folder.name}"[:40]
        for r in range(self.world):
            h = self.host_of(r)
            rank_env = dict(os.environ)
            rank_env.update({
                "RANK": str(r), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(r % self.per_host),
                "LOCAL_WORLD_SIZE": str(self.per_host), "MASTER_ADDR": self.ns.root_addr,
                "MASTER_PORT": str(self.store.port), "ODC_FABRIC_ADDR": self.ns.addrs[h],
                "GLOO_SOCKET_IFNAME": self.ns.ifnames[h], "ODC_JOB_KEY": job, "ODC_TIMEOUT_S": str(timeout_s),
                "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
                "TORCH_CPP_LOG_LEVEL": "ERROR",
            })
            rank_env.pop("ODC_TRANSPORT", None)
            rank_env.update(env or {})
            err_path = self.folder / f"rank{r}.err"
            if os.environ.get("ODC_TEST_SPAWN") == "1":  # a new interpreter per rank, as before
                cmd = [*self.ns.exec_prefix(h), sys.executable, str(WORKER), str(self.folder), json.dumps(steps)]
                with open(err_path, "wb") as err:
                    self.procs[r] = subprocess.Popen(cmd, env=rank_env, stdout=err, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL)
                continue
            proc = _dist._context().Process(target=_forked_rank, name=f"rank{r}",
                                            args=(self.ns.names[h], rank_env, str(err_path), str(self.folder), steps))
            proc.start()
            self.procs[r] = _Forked(proc)

    def wait(self, deadline_s: float, step: int = 0) -> dict[int, Outcome]:
        """Waits for every rank (killing those still running after ``deadline_s``); returns step ``step``'s outcomes."""
        end = time.monotonic() + deadline_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, end - time.monotonic()))
        self.kill_all()
        return {r: self.outcome(r, step) for r in self.procs}

    def outcomes(self, step: int) -> dict[int, Outcome]:
        """Every rank's outcome of step ``step`` (after :meth:`wait`)."""
        return {r: self.outcome(r, step) for r in self.procs}

    def outcome(self, rank: int, step: int = 0) -> Outcome:
        p = self.procs[rank]
        err_path = self.folder / f"rank{rank}.err"
        stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
        path = self.folder / f"rank{rank}.s{step}.json"
        if not path.exists():
            status = "hung" if p.returncode == -signal.SIGKILL and rank not in self.killed else "silent"
            return Outcome(rank, status, stderr=stderr, returncode=p.returncode)
        d = json.loads(path.read_text())
        return Outcome(rank, d["status"], d.get("value"), d.get("type", ""), d.get("message", ""), d.get("peer"),
                       d.get("elapsed"), stderr, p.returncode)

    def wait_ready(self, ranks: list[int], timeout_s: float = 120.0) -> None:
        """Waits until every rank in ``ranks`` wrote its ready file (a rank that exits first fails the test)."""
        end = time.monotonic() + timeout_s
        while True:
            missing = [r for r in ranks if not (self.folder / f"ready-{r}").exists()]
            if not missing:
                return
            gone = [r for r in missing if self.procs[r].poll() is not None]
            if gone or time.monotonic() > end:
                self.kill_all()
                skip_if_unavailable({r: self.outcome(r) for r in gone})
                why = "exited" if gone else f"not ready within {timeout_s:.0f} s"
                outs = "\n".join(self.outcome(r).describe() for r in sorted(self.procs))
                pytest.fail(f"rank {(gone or missing)[0]} {why}\n{outs}")
            time.sleep(0.05)

    def go(self) -> None:
        (self.folder / "go").write_text("go")

    def kill(self, rank: int) -> None:
        """SIGKILLs one rank, as a host crash would."""
        self.killed.add(rank)
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(timeout=10)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def skip_or_fail(why: str) -> None:
    """Skips the calling test for a limit of this machine or build; under ``ODC_REQUIRE_NETNS=1`` (CI, on a machine
    that has namespaces and a full build) fails it instead, so that a skip never stands in for a pass there."""
    if os.environ.get("ODC_REQUIRE_NETNS") == "1":
        pytest.fail(f"ODC_REQUIRE_NETNS=1, but {why}")
    pytest.skip(why)


def skip_if_unavailable(outs: dict[int, Outcome]) -> dict[int, Outcome]:
    """Skips the test when a rank found the feature under test absent from this build (see :func:`skip_or_fail`)."""
    missing = [o for o in outs.values() if o.status == "unavailable"]
    if missing:
        skip_or_fail(f"{missing[0].message} is not available in this build")
    return outs


def require_ok(outs: dict[int, Outcome]) -> dict[int, Any]:
    """Every rank's value; fails with every rank's report (and stderr) unless all succeeded.

    Skips when a rank found the feature under test absent from this build.
    """
    skip_if_unavailable(outs)
    bad = [o for o in outs.values() if o.status != "ok"]
    if bad:
        pytest.fail("ranks failed:\n" + "\n".join(o.describe() for o in sorted(outs.values(), key=lambda o: o.rank)))
    return {r: o.value for r, o in outs.items()}


@contextlib.contextmanager
def cluster(tmp_path: Path, hosts: int = 2, per_host: int = 2) -> Iterator[Cluster]:
    """``hosts`` namespaces × ``per_host`` ranks; everything is torn down on exit (see the module doc)."""
    import torch.distributed as dist

    why = unavailable_reason()
    if why is not None:
        skip_or_fail(f"multi-host tests need network namespaces: {why}")
    ns = Namespaces(hosts)
    try:
        ns.create()
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        skip_or_fail(f"multi-host tests need network namespaces: creating them was refused: {e}")
    c = None
    try:
        world = hosts * per_host
        store = dist.TCPStore(ns.root_addr, 0, world + 1, is_master=True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        c = Cluster(ns, per_host, tmp_path, store)
        yield c
    finally:
        if c is not None:
            c.kill_all()
            c.store = None
        ns.close()
