"""A real `twospeed serve` process for the end-to-end tests, and the readers they share: /metrics parsed with
prometheus_client, server-sent events, waiting for the server to go idle."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx

# Engine options shared by the server and the in-process reference, so both run the same model.
ENGINE = dict(num_gpu_blocks=96, block_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
              min_prompt_share=0)  # the step target reported is the one set, however slow the machine


# -- the server process ---------------------------------------------------------------------------
class ServerProcess:
    """`twospeed serve` in a subprocess; its output is drained by a thread (kept for failure messages)."""

    def __init__(self, *args: str, ready_timeout: float = 120.0):
        from twospeed.builtin.demo import demo_checkpoint_path

        demo_checkpoint_path()  # build the demo checkpoint here once, never by two processes at a time
        flags = []
        for key, value in ENGINE.items():
            flags += [f"--{key.replace('_', '-')}", str(value)]
        cmd = [sys.executable, "-m", "twospeed.cli", "serve", "--model", "demo", "--port", "0", "--log-level",
               "warning", *flags, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        try:
            self.url = ready.get(timeout=ready_timeout)
        except queue.Empty:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines)) from None
        if self.url is None:
            raise RuntimeError("server exited:\n" + "".join(self.lines))
        self.base = self.url.removesuffix("/v1")

    def _drain(self, ready: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(r"serving .* at (http://\S+/v1)", line):
                ready.put(m.group(1))
        ready.put(None)

    def stop_clean(self) -> None:
        """Stop, and check the server exited 0 and logged no traceback (it logs one for any unexpected error)."""
        assert self.stop() == 0, "".join(self.lines[-50:])
        assert not any("Traceback" in line for line in self.lines), "".join(self.lines[-80:])

    def stop(self, sig=None, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig) if sig else self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


def parse_metrics(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} from the Prometheus text format, by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(metrics: dict, name: str, **labels) -> float:
    """The sum of a sample over every label set that matches `labels`."""
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def scrape(base: str) -> dict:
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_idle(base: str, timeout: float = 30.0) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base)
        busy = (metric_sum(m, "twospeed_num_requests_running") + metric_sum(m, "twospeed_num_requests_waiting"),
                metric_sum(m, "twospeed_kv_cache_usage_ratio"))
        if busy == (0, 0):
            return m
        assert time.monotonic() < deadline, f"server not idle after {timeout}s: running+waiting, kv usage = {busy}"
        time.sleep(0.1)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
