"""ClusterConfig: how many engine replicas, how requests are routed to them, and where Ray runs.

The engine's own options (EngineConfig) and the HTTP server's (ServerConfig) are the same as for
`twospeed serve`; every replica gets the same EngineConfig, so the ingress can prepare and validate a request
once for all of them. No Ray and no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTERS = ("prefix", "least-loaded", "round-robin")


@dataclass(slots=True)
class ClusterConfig:
    """Replicas, routing and the Ray cluster."""

    replicas: int = 2  # engine replica deployments (engine-0 .. engine-N-1), one Ray actor each
    router: str = "prefix"  # "prefix" (cache-aware), "least-loaded" or "round-robin"
    ray_address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); None = start one here
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (fractions pack several on one core)
    replica_threads: int = 1  # torch / OpenMP threads each replica computes with
    replica_gpus: float = 0.0  # Ray GPUs each replica reserves (with --device cuda)
    ingress_cpus: float = 0.0  # Ray CPUs the ingress reserves (it prepares requests; the work is light)
    app_name: str = "twospeed"  # the Ray Serve application
    attach_to: str | None = None  # deploy only an ingress, routing to this running application's replicas
    route_prefix: str | None = None  # where the API is mounted on Ray Serve's proxy; None = "/" ("/APP" attached)
    queue_threshold: int = 4  # prefix router: a replica with this many sequences waiting is overloaded
    kv_threshold: float = 0.9  # prefix router: ... or this share of its KV blocks in use
    imbalance_threshold: int = 4  # prefix router: ... or this many more sequences in flight than the least loaded
    max_prefix_blocks: int = 512  # blocks of a prompt the prefix router hashes (512 x 16 = the first 8k tokens)
    direct_streams: bool = True  # requests stream over a TCP connection to each replica (cluster/channel.py);
    #                               False: through Ray Serve's DeploymentHandle, a longer hop
    # Niceness of each replica's engine process over its actor's (0-19). The route and the streams (the ingress,
    # the replica actors) run at niceness 0 and the engines at this, so on cores the engines keep busy the hop
    # preempts a step at once instead of waiting out its time slice: a route p99 of ~6 ms on loopback at equal
    # niceness, ~2 ms with the gap (benchmarks/bench_route_hop.py). A step loses only what the hop takes.
    engine_nice: int = 15
    probe_interval: float = 1.0  # seconds between the ingress's health and load probes of each replica
    probe_timeout: float = 5.0  # seconds a probe may take before the replica counts as down

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        if self.replica_cpus < 0 or self.replica_gpus < 0 or self.ingress_cpus < 0 or self.replica_threads < 1:
            raise ValueError("replica_cpus, replica_gpus and ingress_cpus must be >= 0 and replica_threads >= 1")
        if (self.queue_threshold < 1 or not 0 < self.kv_threshold <= 1 or self.max_prefix_blocks < 1
                or self.imbalance_threshold < 0):
            raise ValueError("queue_threshold and max_prefix_blocks must be >= 1, kv_threshold in (0, 1], "
                             "imbalance_threshold >= 0")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in 0..19, got {self.engine_nice}")
        if not self.probe_interval > 0 or not self.probe_timeout > 0:
            raise ValueError("probe_interval and probe_timeout must be > 0")

    @property
    def prefix(self) -> str:
        if self.route_prefix is not None:
            return self.route_prefix
        return "/" if self.attach_to is None else f"/{self.app_name}"

    @property
    def replica_names(self) -> list[str]:
        return [f"engine-{i}" for i in range(self.replicas)]
