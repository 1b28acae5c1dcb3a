"""The Ray Serve application (engine replicas + ingress) and `twospeed serve --replicas N`.

build_cluster_app binds N engine deployments (engine-0 .. engine-N-1, one replica each, with their own CPUs,
GPUs and threads) and the ingress that routes to them; with ClusterConfig.attach_to, only an ingress that
routes to a running application's replicas. run_cluster starts a local Ray (or joins --ray-address), starts
Ray Serve's HTTP proxy on --host/--port, deploys the application, prints where it serves, and on SIGTERM or
SIGINT deletes it (in-flight requests get --shutdown-grace seconds) and stops what it started.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading

from twospeed.cluster.config import ClusterConfig
from twospeed.config import EngineConfig
from twospeed.server.config import ServerConfig



# Ray Serve runs a replica's user code on a second event loop in its own thread, and the handles' router on a
# third; each request would cross both on its way to the replica. Our replicas' code never blocks its loop (the
# engine and the request preparation have threads of their own), so they run on the replica's main loop.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


# Ray starts its workers at niceness 15 (below its own daemons), which would put the ingress and the replica actors,
# the route and every stream, below any process at the default 0 on the node (a client, an agent): there a ~1 ms
# hop took 10-16 ms beside two busy processes (benchmarks/bench_route_hop.py). A Ray started here runs them at 0;
# the engines take ClusterConfig.engine_nice. A cluster joined with --ray-address keeps its own (`ray start` with
# RAY_worker_niceness=0 does the same).
WORKER_NICE = 0


def build_cluster_app(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig):
    """The Ray Serve application to deploy (serve.run)."""
    from ray import serve

    from twospeed.cluster.ingress import Ingress
    from twospeed.cluster.replica import EngineReplica

    ongoing = max(1024, 4 * (server_config.max_waiting + engine_config.scheduler.max_num_seqs))
    grace = server_config.shutdown_grace
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", num_replicas=1, max_ongoing_requests=ongoing,
                               ray_actor_options={"num_cpus": cluster.ingress_cpus,
                                                  "runtime_env": {"env_vars": dict(SERVE_ENV)}},
                               graceful_shutdown_timeout_s=grace + 2)
    if cluster.attach_to is not None:
        return ingress.bind(engine_config, server_config, cluster)
    threads = engine_config.num_threads or cluster.replica_threads  # --num-threads wins where given
    replica_engine = dataclasses.replace(engine_config, num_threads=threads)
    replica_server = dataclasses.replace(server_config, engine_nice=cluster.engine_nice)
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **SERVE_ENV}
    engines = [serve.deployment(EngineReplica, name=name, num_replicas=1, max_ongoing_requests=ongoing,
                                ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus,
                                                   "runtime_env": {"env_vars": env}},
                                graceful_shutdown_timeout_s=grace, health_check_period_s=2.0,
                                health_check_timeout_s=30.0).bind(replica_engine, replica_server, name, threads)
               for name in cluster.replica_names]
    return ingress.bind(engine_config, server_config, cluster, *engines)


def start_ray(cluster: ClusterConfig, log_to_driver: bool = False) -> bool:
    """Join cluster.ray_address, or start a local Ray on loopback with CPUs for every replica; True if started."""
    import ray

    if ray.is_initialized():
        return False
    if cluster.ray_address is not None:
        ray.init(address=cluster.ray_address, log_to_driver=log_to_driver, logging_level=logging.WARNING)
        return False
    cpus = max(os.cpu_count() or 1, math.ceil(cluster.replicas * cluster.replica_cpus + cluster.ingress_cpus))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=log_to_driver, logging_level=logging.WARNING,
             _system_config={"worker_niceness": WORKER_NICE})
    return True


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def deploy(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig) -> str:
    """Start Serve's proxy (if it is not running) and deploy the application; returns the API's URL."""
    from ray import serve

    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin

    if is_builtin(engine_config.model) and cluster.attach_to is None:
        builtin_checkpoint_path(engine_config.model)  # built once here, before the replicas and the ingress look
    host = server_config.host
    port = server_config.port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_cluster_app(engine_config, server_config, cluster), name=cluster.app_name,
              route_prefix=cluster.prefix, blocking=False)
    port = _proxy_port(port)
    return f"http://{host}:{port}{cluster.prefix.rstrip('/')}/v1"


def _proxy_port(asked: int) -> int:
    """The port Ray Serve's proxy listens on: a Serve instance that was already running keeps its own."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.port
    except Exception:  # a private API of Ray Serve: fall back to the port asked for
        return asked


def run_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                log_level: str = "info") -> int:
    """`twospeed serve --replicas N`: serve until SIGTERM/SIGINT, then delete the application and stop."""
    from ray import serve

    started = start_ray(cluster, log_to_driver=log_level == "debug")
    stop = threading.Event()
    try:
        url = deploy(engine_config, server_config, cluster)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's own (ray.init's exits at once, leaving the app)
            signal.signal(sig, lambda *_: stop.set())
        print(f"twospeed: serving {server_config.served_model_name or engine_config.model!r} at {url} "
              f"({cluster.replicas} replicas, router {cluster.router}, Ray Serve application {cluster.app_name!r})",
              flush=True)
        while not stop.wait(1.0):
            pass
        # In-flight requests get the grace (Serve's graceful shutdown); a Ray that is gone cannot hang the exit.
        deleting = threading.Thread(target=serve.delete, args=(cluster.app_name,), daemon=True)
        deleting.start()
        deleting.join(server_config.shutdown_grace + 10)
    except Exception as e:
        print(f"twospeed serve: the cluster failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if started:
            import ray

            serve.shutdown()
            ray.shutdown()
    return 0
