"""Screenshots of the memtenants panels in a real TensorBoard, taken by headless Chromium (``make screenshots``).

Writes a seed run (the article's model, a 1 GiB budget so that headroom and max batch size are
drawn), starts ``tensorboard`` on it, and drives Debian's ``chromium`` over the DevTools
protocol on a pipe (no extra package): it opens the custom-scalars dashboard with smoothing off
and every chart's list of matches expanded, and the images dashboard at the image's actual
size, then saves PNGs under ``docs/``.

Run: ``python scripts/screenshots.py [--out docs] [--logdir DIR]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Clicks through shadow roots: TensorBoard's dashboards are Polymer elements.
DEEP = """
function deepAll(root, selector, out = []) {
  root.querySelectorAll(selector).forEach((e) => out.push(e));
  root.querySelectorAll('*').forEach((e) => { if (e.shadowRoot) deepAll(e.shadowRoot, selector, out); });
  return out;
}
"""
EXPAND_MATCHES = (
    DEEP
    + """
(() => {
  const buttons = deepAll(document, '.toggle-matches-button');
  buttons.forEach((b) => b.click());
  deepAll(document, 'tf-custom-scalar-multi-line-chart-card').forEach((card) => { card.style.height = 'auto'; });
  deepAll(document, '#matches-list').forEach((list) => { list.style.maxHeight = 'none'; });
  window.dispatchEvent(new Event('resize'));
  deepAll(document, 'paper-checkbox')
    .filter((c) => c.textContent.includes('Ignore outliers') && c.checked)
    .forEach((c) => c.click());
  return buttons.length;
})()
"""
)
ACTUAL_SIZE = (
    DEEP
    + """
(() => {
  const boxes = deepAll(document, 'paper-checkbox').filter((c) => c.textContent.includes('actual image size'));
  boxes.forEach((c) => { if (!c.checked) c.click(); });
  return boxes.length;
})()
"""
)
UNCLIP = (
    DEEP
    + """
(() => {
  const clipped = deepAll(document, '*').filter((e) => ['auto', 'scroll'].includes(getComputedStyle(e).overflowY)
    && e.scrollHeight > e.clientHeight && e.closest && !e.matches('body, html'));
  clipped.forEach((e) => { e.style.maxHeight = 'none'; e.style.height = 'auto'; e.style.overflowY = 'visible'; });
  return clipped.length;
})()
"""
)


class Chromium:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out, NUL-terminated JSON)."""

    def __init__(self, binary: str, width: int, height: int) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="memtenants-chromium-")
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={self._profile}",
            f"--window-size={width},{height}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        shell = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        self._process = subprocess.Popen(
            ["sh", "-c", shell, binary, *flags],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable", session=True)
        self.width, self.height = width, height

    def send(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buffer += chunk
        raise TimeoutError(method)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def open(self, url: str, settle_s: float) -> None:
        self.send("Page.navigate", session=True, url=url)
        time.sleep(settle_s)

    def screenshot(self, path: Path, height: int, width: int | None = None) -> None:
        width = width or self.width
        self.send(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        time.sleep(1.0)
        data = self.send("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"wrote {path} ({width} x {height})")

    def close(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        shutil.rmtree(self._profile, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.load(response):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tensorboard did not answer {url} within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--logdir", type=Path, default=None, help="an existing run; default: write a seed run")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="memtenants-shots-") as scratch:
        logdir = args.logdir
        if logdir is None:
            logdir = Path(scratch) / "lightning_logs"
            seed = [sys.executable, str(ROOT / "examples" / "seed_mlp.py"), "--logdir", str(logdir)]
            subprocess.run([*seed, "--steps", "12", "--budget", "1GiB"], check=True, stdout=subprocess.DEVNULL)
        port = free_port()
        board = subprocess.Popen(
            [str(VENV_BIN / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        browser = None
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/data/plugin/custom_scalars/layout")
            browser = Chromium(args.chromium, width=1500, height=900)
            browser.open(f"{base}/#custom_scalars&_smoothingWeight=0", settle_s=6)
            print(f"expanded {browser.evaluate(EXPAND_MATCHES)} lists of matches")
            time.sleep(2)
            browser.screenshot(args.out / "tensorboard_custom_scalars.png", height=1780)
            browser.open(f"{base}/#images", settle_s=5)
            print(f"ticked {browser.evaluate(ACTUAL_SIZE)} 'actual image size' box")
            time.sleep(2)
            browser.screenshot(args.out / "tensorboard_desk.png", height=830, width=1620)
            browser.open(f"{base}/#text", settle_s=5)
            print(f"unclipped {browser.evaluate(UNCLIP)} scrolling boxes")
            browser.screenshot(args.out / "tensorboard_text.png", height=1240)
        finally:
            if browser is not None:
                browser.close()
            board.terminate()
            board.wait(10)


if __name__ == "__main__":
    main()
