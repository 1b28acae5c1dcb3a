"""The router's Prometheus metrics (the ingress's own), and /metrics of the cluster: every replica's, merged.

Each replica keeps the metrics `twospeed serve` has (server/metrics.py), observed where the request ran. The
ingress serves them all in one exposition, each sample labelled with its `replica`, followed by the router's:
requests routed by replica and reason, the route time (ingress arrival -> replica arrival) by replica, the
prompt tokens the router expected to find cached, each replica's state as the router sees it, and the streams
lost to a replica that died. Summing a series over `replica` gives the cluster's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

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


class _Families:
    """A collector that yields metric families already built (the replicas' merged ones)."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return self._families


def merge_expositions(parts: list[tuple[str, str]]) -> bytes:
    """One exposition from several replicas' (name, text): each family once, every sample labelled `replica`."""
    families = {}
    for replica, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = type(family)(family.name, family.documentation, family.type,
                                                              family.unit)
            merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
