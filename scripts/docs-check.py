#!/usr/bin/env python3
"""Opens the built docs site in a headless Chromium and fails on an empty page, a failed request or a script error.

    scripts/docs-check.py [--site site] [--screenshots DIR]

Serves the site from 127.0.0.1 (a local HTTP server on a free port: the site's search index and scripts load
with fetch, which a file:// page may not) and drives Debian's ``chromium`` over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no port, no websocket, no browser download). For each page it checks:

- the page loads, and its main content is there (a text the page must show, and more than a few hundred
  characters of it);
- no request failed: every response below 400, no request that could not complete (a 404 of CSS, JS, an
  image or a font, a request to another host, which a site that works offline must not make);
- no script threw, and nothing was logged as an error in the console.

Every step has a deadline, so a hung browser is a failure in seconds. Run by ``make docs`` after the build.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import os
import select
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (page, a text its main content must hold)
PAGES = [
    ("index.html", "decentralized parameter server"),
    ("getting-started.html", "torchrun --nproc-per-node 2 train.py"),
    ("api/fsdp.html", "odc.fsdp.enable"),
    ("api/engine.html", "scatter_accumulate"),
    ("configuration.html", "ODC_TIMEOUT_S"),
    ("errors.html", "PeerTimeout"),
    ("benchmarks/train.html", "Made by"),
    ("rust/odc_core/index.html", "odc_core"),
    ("rust/odc_kernels/index.html", "odc_kernels"),
    ("rust/odc_packing/index.html", "odc_packing"),
]
MIN_TEXT = 300  # characters of main content: a page that rendered its navigation only has less
DEADLINE_S = 120.0  # per command: make test runs this at nice 19 beside the test legs


class CheckError(Exception):
    """The browser could not be driven (no chromium, it exited, a command timed out)."""


class Browser:
    """Chromium with its DevTools protocol on fds 3 (commands in) and 4 (events and replies out)."""

    def __init__(self, exe: str, profile: str) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        args = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
                "--disable-background-networking", "--disable-component-update", "--mute-audio",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        actions = [(os.POSIX_SPAWN_DUP2, cmd_r, 3), (os.POSIX_SPAWN_DUP2, out_w, 4),
                   (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, os.path.join(profile, "chromium.log"), os.O_WRONLY | os.O_CREAT, 0o600)]
        self.pid = os.posix_spawn(exe, args, os.environ, file_actions=actions)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckError("the browser did not answer in time")
            ready, _, _ = select.select([self._out_r], [], [], left)
            if ready:
                chunk = os.read(self._out_r, 1 << 16)
                if not chunk:
                    raise CheckError("the browser exited")
                self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        out: dict[str, Any] = json.loads(msg)
        return out

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = DEADLINE_S) -> dict[str, Any]:
        """Sends a command and returns its result; events that arrive meanwhile are kept in :attr:`events`."""
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise CheckError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def drain(self, seconds: float) -> None:
        """Collects events for ``seconds``."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(CheckError):
            while time.monotonic() < deadline:
                self.events.append(self._read(deadline))

    def wait_event(self, method: str, session: str, timeout: float = DEADLINE_S) -> None:
        """Waits until an event ``method`` of ``session`` arrived (kept in :attr:`events`)."""
        deadline = time.monotonic() + timeout
        seen = len(self.events)
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method and e.get("sessionId") == session:
                    return
            seen = len(self.events)
            self.events.append(self._read(deadline))

    def close(self) -> None:
        with contextlib.suppress(OSError, CheckError):
            self.call("Browser.close", timeout=5)
        for fd in (self._cmd_w, self._out_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; logs nothing (the browser's events say what failed)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def check_page(browser: Browser, base: str, page: str, want: str, shots: Path | None) -> list[str]:
    """Opens one page in a fresh tab; returns what is wrong with it."""
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    problems: list[str] = []
    try:
        for domain in ("Page", "Network", "Runtime", "Log"):
            browser.call(f"{domain}.enable", session=session)
        browser.call("Emulation.setDeviceMetricsOverride",  # a desktop's window: the navigation shows
                     {"width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": False}, session=session)
        browser.events.clear()
        url = f"{base}/{page}"
        nav = browser.call("Page.navigate", {"url": url}, session=session)
        if nav.get("errorText"):
            return [f"{page}: {nav['errorText']}"]
        browser.wait_event("Page.loadEventFired", session)
        browser.drain(1.0)  # what the page's scripts load after the load event (search index, workers)
        urls: dict[str, str] = {}
        for e in browser.events:
            if e.get("sessionId") != session:
                continue
            m, p = e.get("method"), e.get("params", {})
            if m == "Network.requestWillBeSent":
                urls[p["requestId"]] = p["request"]["url"]
            elif m == "Network.responseReceived" and p["response"]["status"] >= 400:
                problems.append(f"{page}: HTTP {p['response']['status']} for {p['response']['url']}")
            elif m == "Network.loadingFailed" and not p.get("canceled"):
                problems.append(f"{page}: request failed ({p.get('errorText')}): {urls.get(p['requestId'], '?')}")
            elif m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                problems.append(f"{page}: script error: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                problems.append(f"{page}: console error: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") == "error":
                problems.append(f"{page}: console.error: {[a.get('value') for a in p.get('args', [])]}")
        expr = ("(document.querySelector('article') || document.querySelector('#main-content') || "
                "document.querySelector('main') || document.body).innerText")
        text = browser.call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                            session=session)["result"].get("value") or ""
        if len(text.strip()) < MIN_TEXT:
            problems.append(f"{page}: {len(text.strip())} characters of content (at least {MIN_TEXT} expected)")
        if want not in text:
            problems.append(f"{page}: the content does not show {want!r}")
        if shots is not None:
            png = browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
            (shots / (page.replace("/", "_") + ".png")).write_bytes(base64.b64decode(png))
    finally:
        browser.call("Target.closeTarget", {"targetId": target})
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default=str(ROOT / "site"))
    ap.add_argument("--screenshots", metavar="DIR", help="also save a PNG of each page here")
    args = ap.parse_args()
    site = Path(args.site)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        print("docs-check: no chromium on PATH (make setup installs Debian's chromium)", file=sys.stderr)
        return 1
    missing = [p for p, _ in PAGES if not (site / p).is_file()]
    if missing:
        print(f"docs-check: not in {site}: {', '.join(missing)} (run make docs)", file=sys.stderr)
        return 1
    shots = Path(args.screenshots) if args.screenshots else None
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, name="docs-check-http", daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    problems: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="docs-check-") as profile:
        browser = Browser(exe, profile)
        try:
            for page, want in PAGES:
                problems += check_page(browser, base, page, want, shots)
        except CheckError as e:
            log = Path(profile, "chromium.log").read_text(errors="replace")[-2000:]
            problems.append(f"the browser: {e}\n{log}")
        finally:
            browser.close()
            server.shutdown()
    for p in problems:
        print(f"docs-check: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"docs-check: {len(PAGES)} pages opened in headless Chromium, each with its content and no failed "
          f"request or script error ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
