"""`twospeed` command line. Engine options are generated from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
import time

from twospeed.config import CacheConfig, EngineConfig, add_engine_args, engine_kwargs

# -- demo ----------------------------------------------------------------------------------------------
WORDS = ("latency throughput prefill decode token cache block schedule request stream batch memory "
         "bandwidth compute kernel attention query key value layer weight model server client budget").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def demo_workload(seed: int = 0) -> list[tuple[float, str, str, int]]:
    """(arrival offset s, label, prompt, max_tokens): short chats, one long document, two turns on one prefix."""
    rng = random.Random(seed)
    system = "You are a careful assistant. Tools: " + _text(rng, 700)
    items = [(0.0, f"short-{i}", _text(rng, rng.randint(10, 40)), 48) for i in range(4)]
    items.append((0.0, "long-doc", "Summarise: " + _text(rng, 900), 24))  # ~2k tokens
    items.append((0.0, "prefix-turn-1", system + " User: " + _text(rng, 20), 32))
    items.append((1.0, "prefix-turn-2", system + " User: " + _text(rng, 25), 32))
    items += [(1.2, f"short-{i}", _text(rng, rng.randint(10, 40)), 48) for i in range(4, 6)]
    return items


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from twospeed import LLM, SamplingParams
    from twospeed.report import print_report

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)  # a log file or CI: don't squeeze the tables to 80 columns
    console.print(f"[bold]twospeed demo[/bold]: loading {args.model!r} ...")
    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    cfg = engine.scheduler_config
    console.print(f"{engine.model_config.architecture}, {engine.model_config.num_params / 1e6:.0f}M params, "
                  f"{engine.dtype}, {engine.num_blocks} KV blocks x {engine.kv.block_size} tokens, "
                  f"budget {cfg.max_num_batched_tokens} tokens/step, chunked prefill "
                  f"{'on' if cfg.enable_chunked_prefill else 'off'}, prefix cache "
                  f"{'on' if engine.config.cache.enable_prefix_caching else 'off'}")
    pending = sorted(demo_workload(args.seed or 0), key=lambda x: x[0])
    labels: dict[str, str] = {}
    finished = {}
    start = time.monotonic()
    steps = prefill_tokens = decode_tokens = 0
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            offset, label, prompt, max_tokens = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=len(labels),
                                    ignore_eos=True)
            req = engine.add_request(None, prompt, params, arrival_time=start + offset)
            labels[req.request_id] = label
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        prefill_tokens += engine.last_stats.num_prefill_tokens
        decode_tokens += engine.last_stats.num_decode_tokens
    wall = time.monotonic() - start
    outputs = [finished[rid] for rid in labels]
    print_report(outputs, wall, [labels[o.request_id] for o in outputs], console)
    console.print(f"{steps} engine steps: {prefill_tokens:,} prefill tokens and {decode_tokens:,} decode tokens "
                  f"computed; {engine.scheduler.num_preemptions} preemptions; KV blocks cached for reuse: "
                  f"{engine.kv.num_cached_blocks}")
    return 0


# -- serve ---------------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ServerConfig (twospeed/server/config.py); defaults live there, not here."""
    parser.add_argument("--host", help="address to bind (default 127.0.0.1: loopback only)")
    parser.add_argument("--port", type=int, help="port (default 8000; 0 = any free port, the printed URL says which)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route (but see the next two)")
    parser.add_argument("--metrics-public", action="store_true", default=None,
                        help="with --api-key: leave /metrics, /health and /dashboard open")
    parser.add_argument("--docs-public", action="store_true", default=None,
                        help="with --api-key: leave /openapi.json, /docs and /redoc open")
    parser.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    parser.add_argument("--max-waiting", type=int,
                        help="sequences admitted but not yet scheduled (default 256); beyond it: 429 + Retry-After")
    parser.add_argument("--shutdown-grace", type=float,
                        help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    parser.add_argument("--slo", action="append", metavar="LANE:METRIC=DURATION[,...]",
                        help="a lane's SLO, e.g. drafting:ttft_p99=500ms,itl_p99=60ms (repeatable)")
    parser.add_argument("--slo-file", help="YAML: {lanes: {LANE: {METRIC: DURATION}}}")
    parser.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 16 MiB), else 413")
    parser.add_argument("--max-stream-backlog", type=int,
                        help="bytes of a stream's output that may wait for its client (default 8 MiB); past them the "
                             "client is taken as gone and the request aborted")
    parser.add_argument("--max-tokens-policy", choices=("error", "clamp"),
                        help="a max_tokens beyond the room the prompt leaves: 400 naming both numbers (error, the "
                             "default, as OpenAI and vLLM) or cut to the room (clamp)")
    parser.add_argument("--prep-threads", type=int,
                        help="worker threads that parse, tokenize and compile requests off the event loop (default 2)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="step the engine in a process of its own, where the HTTP side never takes the GIL from "
                             "a step (the default); --no-engine-process: in a thread of the server's process")
    parser.add_argument("--engine-nice", type=int, metavar="N",
                        help="niceness added to the engine process (0-19, default 0; 15 behind --replicas): the "
                             "server's own work (a request, the route, a stream) then preempts a step on shared cores")
    parser.add_argument("--history-minutes", type=float,
                        help="minutes of steps and requests /dashboard keeps in memory (default 15)")
    parser.add_argument("--history-requests", type=int, help="ended sequences /dashboard keeps (default 4096)")
    parser.add_argument("--price", metavar="INPUT,CACHED,OUTPUT",
                        help="the dashboard's price table: dollars per 1M prefilled input, cached input, output tokens")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    cluster = parser.add_argument_group("scale-out on Ray Serve (twospeed[cluster]; twospeed/cluster/config.py)")
    cluster.add_argument("--replicas", type=int, help="engine replicas behind one endpoint (default: one engine here)")
    cluster.add_argument("--router", help="how requests pick a replica: prefix (default), least-loaded, round-robin")
    cluster.add_argument("--ray-address", help="join this Ray cluster (e.g. auto) instead of starting one here")
    cluster.add_argument("--replica-cpus", type=float, help="Ray CPUs each replica reserves (default 1)")
    cluster.add_argument("--replica-threads", type=int, help="torch threads each replica computes with (default 1)")
    cluster.add_argument("--replica-gpus", type=float, help="Ray GPUs each replica reserves (default 0)")
    cluster.add_argument("--app-name", help="the Ray Serve application's name (default twospeed)")
    cluster.add_argument("--attach-to", metavar="APP", help="deploy only an ingress over APP's running replicas "
                                                           "(another router over the same engines)")
    cluster.add_argument("--direct-streams", action=argparse.BooleanOptionalAction, default=None,
                         help="requests stream over a TCP connection to each replica (the default); "
                              "--no-direct-streams: through Ray Serve's handle")


def _cluster_config(args: argparse.Namespace):
    from twospeed.cluster.config import ClusterConfig

    names = {"replicas", "router", "ray_address", "replica_cpus", "replica_threads", "replica_gpus", "app_name",
             "attach_to", "direct_streams", "engine_nice"}
    config = ClusterConfig(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    if config.attach_to is not None and config.ray_address is None:
        raise ValueError("--attach-to needs --ray-address: the Ray cluster the application runs on")
    return config


def run_serve(args: argparse.Namespace) -> int:
    from twospeed.server.config import ServerConfig

    names = [f.name for f in dataclasses.fields(ServerConfig)]
    clustered = args.replicas is not None or args.attach_to is not None
    try:
        cluster = _cluster_config(args) if clustered else None
        if clustered:
            from twospeed.cluster import keep_ray_on_loopback, require_ray

            if cluster.ray_address is None:
                keep_ray_on_loopback()
            require_ray()
        engine_config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
        server_config = ServerConfig(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
        server_config.lanes()  # a bad --slo fails here, with its message
        from twospeed.builtin.registry import is_builtin, resolve_model_path
        if not is_builtin(args.model):  # a built-in is built (torch, in the main thread) only in the engine thread
            resolve_model_path(args.model)  # a wrong --model fails here, before uvicorn starts
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"twospeed serve: {e}", file=sys.stderr)
        return 2
    if clustered:
        from twospeed.cluster.deploy import run_cluster

        return run_cluster(engine_config, server_config, cluster, log_level=args.log_level)
    spawn = None
    if server_config.engine_process:  # first: torch loads in the engine while the web stack loads here
        from twospeed.serving.engine_spawn import EngineSpawn

        spawn = EngineSpawn.start(engine_config, server_config.engine_nice)
    from twospeed.server.app import run_server

    rc = run_server(engine_config, server_config, log_level=args.log_level, engine=spawn)
    # Everything is shut down by now (responses ended, the engine thread joined, logs written): skip the
    # interpreter's teardown of torch and the model (~0.5 s), so the process exits when the grace says.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# -- prefix-score, clock ------------------------------------------------------------------------------
def add_prefix_score_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", metavar="PROMPTS.jsonl", help='one {"prompt": ...} or {"messages": [...]} per line')
    parser.add_argument("--tokenizer", help="HF checkpoint folder or tokenizer.json (default: the demo model's)")
    parser.add_argument("--block-size", type=int, default=CacheConfig().block_size, help="KV block size in tokens")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_prefix_score(args: argparse.Namespace) -> int:
    from twospeed.lab.prefix_score import run

    return run(args.prompts, args.tokenizer, args.block_size, args.json)


def add_clock_args(parser: argparse.ArgumentParser) -> None:
    from twospeed.plan.commands import add_clock_args as add

    add(parser)


def run_clock(args: argparse.Namespace) -> int:
    from twospeed.plan.commands import run_clock as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twospeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate a small mixed batch and print the split clock and bill")
    add_engine_args(demo)
    demo.set_defaults(func=run_demo)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with the split clock, /metrics and lane SLOs")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
    prefix_score = sub.add_parser("prefix-score", help="predict prefix-cache hits of a harness's successive prompts")
    add_prefix_score_args(prefix_score)
    prefix_score.set_defaults(func=run_prefix_score)
    clock = sub.add_parser("clock", help="toy two-clocks model of prefill vs decode, or the roofline of a model")
    add_clock_args(clock)
    clock.set_defaults(func=run_clock)
    from twospeed.plan import sim_commands as planner  # the planner's flags live with the planner

    # conflict_handler: the planner's own format flags win over engine flags of the same name
    simulate = sub.add_parser("simulate", conflict_handler="resolve",
                              help="a workload through simulated replicas (the engine's own scheduler): results.json")
    planner.add_simulate_args(simulate)
    simulate.set_defaults(func=planner.run_simulate_command)
    plan = sub.add_parser("plan", conflict_handler="resolve",
                          help="capacity: max rate per replica under every lane's SLO, replicas, budgets, formats, "
                               "pools; `plan calibrate` fits a step profile on the live engine")
    planner.add_plan_args(plan)
    plan.set_defaults(func=planner.run_plan_command)
    from twospeed.lab import commands as lab  # the lab's flags live with the lab

    bench = sub.add_parser("bench", help="replay a workload against an OpenAI-compatible server; per-lane report")
    lab.add_bench_args(bench)
    bench.set_defaults(func=lab.run_bench_command)
    compare = sub.add_parser("compare", help="compare bench runs lane by lane, with the noise")
    lab.add_compare_args(compare)
    compare.set_defaults(func=lab.run_compare_command)
    diagnose = sub.add_parser("diagnose", help="which speed hurt each lane of a bench run, and which lever to pull")
    lab.add_diagnose_args(diagnose)
    diagnose.set_defaults(func=lab.run_diagnose_command)
    gate = sub.add_parser("gate", help="serve a baseline and a candidate configuration, replay the same regression, "
                                       "and say ship or no-ship per lane (exit code 1 on any no-ship)")
    lab.add_gate_args(gate)
    gate.set_defaults(func=lab.run_gate_command)
    lab_demo = sub.add_parser("lab-demo", help="serve smollm2 (or demo-task) with chunked prefill on, then off; compare")
    lab.add_lab_demo_args(lab_demo)
    lab_demo.set_defaults(func=lab.run_lab_demo_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
