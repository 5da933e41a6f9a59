"""Diagnostic: every Python garbage collection of 5 ms or more, in every process that starts with
this directory on PYTHONPATH (the benchmark, torchrun, each rank), appended to
/tmp/gclog/<pid>.log as `<unix time> gen<N> <ms> collected=<n> rank=<RANK>`. Compare the times with
the `train` events of the run to see whether a slow step was a collection.

    PYTHONPATH=$PWD/bench/gcprobe:$PWD python bench/throughput.py --variants plan.jsonl --steps 30 --workdir /tmp/bw
"""
import gc
import os
import time

_started: dict[str, float] = {}
_LOG = f"/tmp/gclog/{os.getpid()}.log"


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started["t"] = time.perf_counter()
    elif "t" in _started:
        took = time.perf_counter() - _started.pop("t")
        if took >= 0.005:
            os.makedirs(os.path.dirname(_LOG), exist_ok=True)
            with open(_LOG, "a") as log:
                log.write(f"{time.time():.3f} gen{info['generation']} {took * 1000:.1f}ms "
                          f"collected={info['collected']} rank={os.environ.get('RANK')}\n")


gc.callbacks.append(_timed)
