"""Ingress: the Ray Serve deployment that serves the OpenAI-compatible API of the whole cluster.

It runs the very app `twospeed serve` runs (server/app.py: the same routers, preparation off the event loop,
errors, auth, lanes and SLOs, SSE streaming), with a ClusterEngine (client.py) behind it in place of the local
engine thread, and the cluster's /metrics and /dashboard/data (routes.py) in front. Ray Serve's HTTP proxy
hands it each request. The engine replicas come as DeploymentHandles (bound in deploy.py), or, with
ClusterConfig.attach_to, are looked up in a running application (another router over the same replicas).
"""

from __future__ import annotations

from twospeed.cluster import routes
from twospeed.cluster.client import ClusterEngine
from twospeed.cluster.config import ClusterConfig
from twospeed.config import EngineConfig
from twospeed.server.app import build_app
from twospeed.server.config import ServerConfig


class Ingress:
    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                       *handles):
        names = cluster.replica_names
        if cluster.attach_to is not None:
            names = _replicas_of(cluster.attach_to) or names
            from ray import serve

            handles = [serve.get_deployment_handle(name, app_name=cluster.attach_to) for name in names]
        model_name = server_config.served_model_name or engine_config.model
        client = ClusterEngine(dict(zip(names, handles)), cluster, model_name)
        self._app = build_app(engine_config, server_config, client=client, routers=(routes,))

    def __serve_build_asgi_app__(self):
        """Ray Serve's hook for an ingress whose app is built in the replica (after __init__)."""
        return self._app


def _replicas_of(app: str) -> list[str]:
    """The engine deployments of a running application (engine-0, engine-1, ...), in order."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        raise RuntimeError(f"--attach-to {app}: no Ray Serve application of that name is running")
    names = [name for name in status.deployments if name.startswith("engine-")]
    return sorted(names, key=lambda name: int(name.rsplit("-", 1)[1]))
