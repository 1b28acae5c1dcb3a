"""The router's Prometheus metrics (the ingress's own), and /metrics of the cluster: every replica's, merged.

Each replica keeps the metrics `twospeed serve` has (server/metrics.py), observed where the request ran. The
ingress serves them all in one exposition, each sample labelled with its `replica`, followed by the router's:
requests routed by replica and reason, the route time (ingress arrival -> replica arrival) by replica, the
prompt tokens the router expected to find cached, each replica's state as the router sees it, and the streams
lost to a replica that died. Summing a series over `replica` gives the cluster's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from twospeed.cluster.router import REASONS
from twospeed.server.metrics import geometric_buckets

# 0.1 ms - 10 s, 10 to a decade: the hop is ~1 ms on loopback, seconds while a replica restarts.
ROUTE_BUCKETS = geometric_buckets(0.0001, 10.0, 10)


class RouterMetrics:
    def __init__(self, model_name: str, replicas: list[str]):
        self.model = model_name
        self.registry = r = CollectorRegistry(auto_describe=True)
        rm = ("replica", "model")
        self.routed = Counter("twospeed_router_requests", "requests routed, by replica and reason "
                              "(prefix, overloaded, least_loaded, round_robin, failover)",
                              ("replica", "model", "reason"), registry=r)
        self.route_time = Histogram("twospeed_router_route_time_seconds",
                                    "arrival at the ingress -> arrival at the replica, per request", rm,
                                    buckets=ROUTE_BUCKETS, registry=r)
        self.matched = Counter("twospeed_router_prefix_matched_tokens",
                               "prompt tokens the prefix router expected the replica to have cached", rm, registry=r)
        self.up = Gauge("twospeed_router_replica_up", "1 while the replica answers, 0 after it died until it is back",
                        rm, registry=r)
        self.in_flight = Gauge("twospeed_router_replica_in_flight", "sequences sent to the replica, not yet ended",
                               rm, registry=r)
        self.lost = Counter("twospeed_router_lost_requests", "requests that were running on a replica when it died",
                            rm, registry=r)
        self.restarts = Counter("twospeed_router_replica_restarts", "new instances of the replica seen by the router",
                                rm, registry=r)
        for name in replicas:
            for reason in REASONS:
                self.routed.labels(name, model_name, reason)
            for metric in (self.route_time, self.matched, self.up, self.in_flight, self.lost, self.restarts):
                metric.labels(name, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_expositions(parts: list[tuple[str, str]]) -> bytes:
    """One exposition from several replicas' (name, text): each family once, every sample labelled `replica`.

    Line by line, without parsing a value: the replicas' texts are prometheus_client's own output (a family's
    # HELP and # TYPE lines, then its samples), so a sample line only needs the label spliced in after its name.
    Parsing them with prometheus_client's parser and rendering them again took ~9 s of the ingress's event loop in
    two minutes of a lab run that scraped /metrics (a py-spy profile), every request's route waiting behind it."""
    families: dict[str, list[str]] = {}
    for replica, text in parts:
        label = 'replica="' + replica.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines: list[str] = []
        header = False  # this replica's # lines go in only for a family no replica before it had
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                header = name not in families
                lines = families.setdefault(name, [])
            if line.startswith("#"):
                if header:
                    lines.append(line)
            elif line:
                name, brace, rest = line.partition("{")
                if not brace:  # no labels: `name value`
                    name, _, rest = line.partition(" ")
                    rest = "} " + rest
                lines.append(f"{name}{{{label}{'' if rest.startswith('}') else ','}{rest}")
    return "".join(line + "\n" for lines in families.values() for line in lines).encode()
