"""Scale-out on Ray Serve: engine replicas behind a prefix-aware router, one OpenAI-compatible endpoint.

`twospeed serve --replicas N` (deploy.py) runs N engine replicas (replica.py: each an AsyncEngine in a Ray actor)
and an ingress (ingress.py) serving the same API as `twospeed serve`, whose engine client (client.py) routes each
request (router.py: by prefix, least-loaded or round-robin) and streams it back over the hop (wire.py), with
the split clock's route_time; /metrics and /dashboard merge the replicas' (metrics.py, history.py, routes.py).
Ray is an optional extra: `pip install twospeed[cluster]`.
"""

from __future__ import annotations


import os

# Ray advertises a node's routable address even for a cluster of one machine; with this set before ray is
# imported it keeps to loopback (127.0.0.1), like its macOS/Windows default. Only for a cluster started here.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def keep_ray_on_loopback() -> None:
    """Before ray is imported: a local Ray cluster binds its services to loopback only."""
    os.environ.update(LOOPBACK_ONLY)


def require_ray() -> None:
    """Raise a clear error when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise RuntimeError("--replicas needs Ray Serve: pip install 'twospeed[cluster]' "
                           f"(ray[serve]); importing it failed: {e}") from None
