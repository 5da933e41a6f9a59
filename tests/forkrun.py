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
as the worker does, can be run under."""
from __future__ import annotations

import atexit
import io
import logging
import multiprocessing
import os
import runpy
import sys

# What a rank imports before it reads its job; the forkserver imports them once per launch.
PRELOAD = ("launcher.train", "launcher.trainer", "launcher.dist", "transformers", "peft",
           "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
           "torch.distributed.checkpoint", "torch.distributed.fsdp")


class _Left(BaseException):
    """launcher.leave.leave's code, carried to rank_main (the elastic agent waits for a rank's
    return value: a rank that ends with os._exit(0) leaves it waiting)."""

    def __init__(self, code: int | None):
        super().__init__(code)
        self.code = code or 0


def _leave(code: int | None) -> None:
    raise _Left(code)


def rank_main(module: str, *args: str) -> None:
    """One rank: `module` run as `__main__` with `args` as its sys.argv, its output unbuffered; a
    non-zero exit code ends the process with that code. A worker that succeeded has closed its
    process group: its process outliving it until every rank is done (the agent's wait) holds
    nothing of its peers'."""
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


if __name__ == "__main__":
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    @record
    def main(argv: list[str]) -> None:
        config, _, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv))
        assert cmd_args[:2] == ["-u", "-m"], cmd_args  # `python -u -m`: rank_main unbuffers the output itself
        config.start_method = "forkserver"
        multiprocessing.set_forkserver_preload(["__main__", *PRELOAD])
        elastic_launch(config=config, entrypoint=rank_main)(*cmd_args[2:])

    main(sys.argv[1:])
