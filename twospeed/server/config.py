"""ServerConfig: how the HTTP server listens, authenticates, admits and shuts down (the engine has its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from twospeed.schema.price import Price
from twospeed.schema.slo import LaneSLO, load_slo_file, parse_slo_flag
from twospeed.server.history import HistoryConfig


@dataclass(slots=True)
class ServerConfig:
    """How the server listens and admits."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0 = any free port (the printed URL says which)
    api_key: str | None = None  # require `Authorization: Bearer KEY` on every route (guard.OPEN_PATHS lists openers)
    metrics_public: bool = False  # with api_key: leave /metrics and /health open
    docs_public: bool = False  # with api_key: leave /docs, /redoc and /openapi.json open
    served_model_name: str | None = None  # the model id clients send; default: "demo" or the folder given
    max_waiting: int = 256  # sequences admitted but not yet scheduled; beyond it new requests get 429
    shutdown_grace: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    slo: list[str] = field(default_factory=list)  # LANE:METRIC=DURATION[,...] specs
    slo_file: str | None = None  # YAML: {lanes: {LANE: {METRIC: DURATION}}}
    max_body_bytes: int = 16 << 20  # bytes a request body may have; larger ones get 413
    # A stream's output waiting for its client, in approximate bytes: past it the client is taken as gone and the
    # request aborted (a client that never reads cannot make the server hold its whole output)
    max_stream_backlog: int = 8 << 20
    # A max_tokens the client set beyond the room its prompt leaves: "error" = 400 naming both numbers (OpenAI, vLLM),
    # "clamp" = cut to the room. One it did not set (completions' default 16) is cut to the room either way.
    max_tokens_policy: Literal["error", "clamp"] = "error"
    prep_threads: int = 2  # worker threads that parse, tokenize, render and compile requests off the event loop
    # The engine in a process of its own (serving/process_engine.py: no HTTP work takes the GIL from a step), or in
    # a thread of the server's process (False: one process, as an embedded engine runs).
    engine_process: bool = True
    # Niceness added to the engine process (0-19). Above 0, on cores the engine shares, the server's own work (an HTTP
    # request, a replica's channel relaying a stream) preempts a step instead of waiting out its time slice; a step
    # loses only what that work takes. Default 0 for one server (not measured there); a cluster's replicas take
    # ClusterConfig.engine_nice (15): the hop's p99 beside busy engines 6 -> 2 ms (benchmarks/bench_route_hop.py).
    engine_nice: int = 0
    history_minutes: float = 15.0  # minutes of steps and requests the dashboard's history keeps (server/history.py)
    history_requests: int = 4096  # ended sequences the history keeps with their clock and bill
    price: str | None = None  # the dashboard's price table: "INPUT,CACHED,OUTPUT" dollars per 1M tokens

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in 0..19, got {self.engine_nice}")
        if self.max_body_bytes < 1 or self.prep_threads < 1:
            raise ValueError("max_body_bytes and prep_threads must be >= 1")
        if self.max_tokens_policy not in ("error", "clamp"):
            raise ValueError(f"max_tokens_policy must be 'error' or 'clamp', got {self.max_tokens_policy!r}")
        self.history()
        self.price_table()

    def history(self) -> HistoryConfig:
        return HistoryConfig(minutes=self.history_minutes, max_requests=self.history_requests)

    def price_table(self) -> Price:
        """Dollars per 1M tokens (all 0 without --price)."""
        return Price.parse(self.price)

    def lanes(self) -> list[LaneSLO]:
        lanes = [parse_slo_flag(s) for s in self.slo]
        if self.slo_file:
            lanes += load_slo_file(self.slo_file)
        return lanes
