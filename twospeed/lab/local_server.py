"""A `twospeed serve` subprocess on a free loopback port, for the lab demo and the lab's end-to-end test."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading


class LocalServer:
    """Starts `twospeed serve --model MODEL --port 0 FLAGS...`, waits for its 'serving ... at URL' line, and
    stops it with SIGTERM (then SIGKILL) on exit. Its output is kept for error messages."""

    def __init__(self, model: str = "demo", flags: list[str] | None = None, ready_timeout: float = 180.0,
                 env: dict | None = None):
        cmd = [sys.executable, "-m", "twospeed.cli", "serve", "--model", model, "--port", "0", "--log-level",
               "warning", *(flags or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        self.lines: list[str] = []
        ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        try:
            url = ready.get(timeout=ready_timeout)
        except queue.Empty:
            url = None
        if url is None:
            self.stop()
            raise RuntimeError("twospeed serve did not start:\n" + "".join(self.lines[-40:]))
        self.url: str = url

    def _drain(self, ready: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "twospeed: serving" in line and " at " in line:
                ready.put(line.split(" at ", 1)[1].split()[0])
        ready.put(None)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
