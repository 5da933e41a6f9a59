"""torchrun for the worker tests, its ranks forked rather than started anew:

    python tests/forkrun.py <torchrun's options> -m launcher.train --run-dir ...

torchrun's own agent (`torch.distributed.run`'s options, rendezvous, environment, exit codes,
signals) with its function entry point: each rank is forked from a multiprocessing forkserver that
has imported the worker's engines once (PRELOAD), then runs the module as `python -u -m` would.
A rank started anew spends most of its CPU importing torch, transformers and peft (docs/
testing.md): on the suite's two cores that start-up, not the training, is what the worker tests
wait for. The product launches with torchrun itself; so do the tests of the launch paths, and
tests/worker.py's other scripts: a forked rank that returns lives on until every rank has (the
agent collects their return values), which only a module that closes its process group first,
as the worker does, can be run under.

A forkserver can serve many launches (`start_server`; tests/worker.py keeps one per test process
and environment its imports read, named to each agent by FORKSERVER_ENV): its imports, about 4
CPU-seconds, are then paid once, not once a launch. Without FORKSERVER_ENV an agent starts a
forkserver of its own. A rank of a shared server is no descendant of its agent, so it takes from
the agent what a descendant would inherit (the environment, standard output and error) and ends
when the agent does."""
from __future__ import annotations

import atexit
import io
import logging
import multiprocessing
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver, reduction, resource_tracker

# What a rank imports before it reads its job; a forkserver imports them once, before its first rank.
PRELOAD = ("launcher.train", "launcher.trainer", "launcher.dist", "transformers", "peft",
           "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
           "torch.distributed.checkpoint", "torch.distributed.fsdp")
# "<socket path>:<fd of the alive pipe's write end>" of a shared forkserver, in an agent's environment.
FORKSERVER_ENV = "SWIFT_STUDIO_TEST_FORKSERVER"
# The environment this module was imported with: in a forkserver, what its ranks start with.
_SERVER_ENV = dict(os.environ)


class _Left(BaseException):
    """launcher.leave.leave's code, carried to rank_main (the elastic agent waits for a rank's
    return value: a rank that ends with os._exit(0) leaves it waiting)."""

    def __init__(self, code: int | None):
        super().__init__(code)
        self.code = code or 0


def _leave(code: int | None) -> None:
    raise _Left(code)


class _AgentFd:
    """One of the agent's file descriptors, passed to a rank as the forkserver passes descriptors."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detached, (reduction.DupFd(self.fd),)


def _detached(dup) -> int:
    return dup.detach()


def _end_with(agent_pid: int) -> None:
    """SIGKILL this process once the agent's is gone (its forkserver's ranks are no descendants of it)."""
    agent = os.pidfd_open(agent_pid)

    def watch() -> None:
        select.select([agent], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def rank_main(agent: dict, module: str, *args: str) -> None:
    """One rank: `module` run as `__main__` with `args` as its sys.argv, its output unbuffered; a
    non-zero exit code ends the process with that code. A worker that succeeded has closed its
    process group: its process outliving it until every rank is done (the agent's wait) holds
    nothing of its peers'. `agent`: its pid, environment, standard output and error, which the
    rank takes in place of its forkserver's, keeping the variables torchrun set for the rank."""
    _end_with(agent["pid"])
    rank_vars = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**agent["env"], **rank_vars})
    os.dup2(agent["stdout"], 1)
    os.dup2(agent["stderr"], 2)
    os.close(agent["stdout"])
    os.close(agent["stderr"])
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors="backslashreplace",
                                            write_through=True))
    import launcher.leave

    launcher.leave.leave = _leave  # bound by the module's `from launcher.leave import leave`, run below
    code: int | str | None = 0
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except _Left as left:
        code = left.code
    except SystemExit as exit_:
        code = exit_.code
    atexit._run_exitfuncs()
    logging.shutdown()
    if code:
        if isinstance(code, str):
            print(code, file=sys.stderr)
        os._exit(code if isinstance(code, int) else 1)


def start_server(env: dict[str, str], cwd: str) -> tuple[subprocess.Popen, str]:
    """A forkserver for many agents, with PRELOAD imported in `env`: the process and the value of
    FORKSERVER_ENV that names it to an agent started with the pipe's write end among its pass_fds.
    It ends once every holder of that end (the caller, the agents, their ranks) has closed it."""
    where = tempfile.mkdtemp(prefix="forkserver-")
    atexit.register(shutil.rmtree, where, True)  # the listening socket outlives its path
    address = os.path.join(where, "socket")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()
    main = os.path.normpath(os.path.abspath(__file__))
    code = (f"from multiprocessing.forkserver import main; "
            f"main({listener.fileno()}, {alive_r}, {['__main__', *PRELOAD]!r}, main_path={main!r})")
    server = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, pass_fds=(listener.fileno(), alive_r))
    listener.close()
    os.close(alive_r)
    return server, f"{address}:{alive_w}"


def alive_fd(named: str) -> int:
    """The alive pipe's write end in a value of FORKSERVER_ENV: an agent's pass_fds."""
    return int(named.rsplit(":", 1)[1])


def _use_server(named: str) -> None:
    """multiprocessing's forkserver of this process: the shared one FORKSERVER_ENV names (started
    by another process, so not waited for, nor started again)."""
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd = named.rsplit(":", 1)[0], alive_fd(named)
    server.ensure_running = resource_tracker.ensure_running


if __name__ == "__main__":
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    @record
    def main(argv: list[str]) -> None:
        config, _, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv))
        assert cmd_args[:2] == ["-u", "-m"], cmd_args  # `python -u -m`: rank_main unbuffers the output itself
        config.start_method = "forkserver"
        if FORKSERVER_ENV in os.environ:
            _use_server(os.environ[FORKSERVER_ENV])
        else:
            multiprocessing.set_forkserver_preload(["__main__", *PRELOAD])
        agent = dict(pid=os.getpid(), env=dict(os.environ), stdout=_AgentFd(1), stderr=_AgentFd(2))
        elastic_launch(config=config, entrypoint=rank_main)(agent, *cmd_args[2:])

    main(sys.argv[1:])
