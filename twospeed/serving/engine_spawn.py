"""EngineSpawn: the engine process started and handed its config, before anything reads its results.

ProcessEngine (process_engine.py) reads an engine process; this starts one. They are apart so that `twospeed serve`
can start its engine first thing, before it imports its web stack: the engine's interpreter then imports torch and
builds the model on one core while the server imports FastAPI and uvicorn on the other, and a server on two cores
is ready about a second sooner. Only light imports here, for the same reason.

The process is a fresh interpreter on engine_child.py's entry point, not multiprocessing's spawn: that re-runs the
user's main module in the child, and a script without an `if __name__ == "__main__"` guard would start a server
there, and it inherits no torch or OpenMP state. This side closes its copies of the child's pipe ends, so the
child's exit is this side's EOF, and this process's exit closes the child's command pipe (the child then stops).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from twospeed.config import EngineConfig

# The engine process's command line. Signals first: Ctrl-C and a service manager's SIGTERM reach the whole process
# group, and the server drains before it stops the engine (or exits, which closes the engine's pipe).
BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "from twospeed.serving.engine_child import boot; boot()")


@dataclass(slots=True, eq=False)
class EngineSpawn:
    config: EngineConfig
    process: subprocess.Popen
    commands: Connection  # this side's end of the command pipe (the config already sent on it)
    results: Connection  # this side's end of the results pipe, unread

    @classmethod
    def start(cls, config: EngineConfig, nice: int = 0) -> EngineSpawn:
        """Start the engine process (its niceness raised by `nice`) and send it its config; returns at once."""
        cmd_recv, cmd_send = os.pipe()
        res_recv, res_send = os.pipe()
        paths = (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))  # this very twospeed
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        argv = [sys.executable, "-c", BOOT, str(cmd_recv), str(res_send), str(os.getpid()), str(nice)]
        process = subprocess.Popen(argv, pass_fds=(cmd_recv, res_send), stdin=subprocess.DEVNULL, env=env)
        os.close(cmd_recv)
        os.close(res_send)
        commands = Connection(cmd_send, readable=False)
        commands.send(config)
        return cls(config, process, commands, Connection(res_recv, writable=False))
