"""What the benchmarks that set the worker against a stock baseline in one call share (bench/dpo.py,
bench/vl.py): their result lines, a baseline process's one JSON line, and a worker run read back
from its rank-0 events."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_memory import gpu0_wrapper, shared_gpu_argv  # noqa: E402
from throughput import ROOT, _first_error, run_error, stop_group, torchrun_argv  # noqa: E402


def driver_parser(doc: str, parts: tuple[str, ...], default: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark made of parts (bench/dpo.py, bench/vl.py); `parts_of` reads --parts."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--parts", default=default, help="of " + ", ".join(parts))
    parser.add_argument("--bsz", type=int, default=8, help="samples (pairs) per micro-batch")
    parser.add_argument("--ranks-bsz", type=int, default=4, help="samples (pairs) per step of the ranks and pipeline parts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", type=Path, default=Path(os.devnull))
    return parser


def parts_of(parser: argparse.ArgumentParser, args: argparse.Namespace, parts: tuple[str, ...]) -> list[str]:
    chosen = args.parts.split(",")
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(parts)})")
    return chosen


class Compared:
    """`steps` a run, the first `warm` of them untimed; `smoke`: gloo ranks on the CPU."""

    def __init__(self, work: Path, steps: int, warm: int, out, smoke: bool):
        self.work, self.steps, self.warm, self.out, self.smoke = work, steps, warm, out, smoke
        self.done: list[dict] = []
        self.wrapper = gpu0_wrapper(work)

    def emit(self, row: dict) -> dict:
        self.done.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        self.out.write(line + "\n")
        self.out.flush()
        return row

    def baseline(self, argv: list[str], failed: dict) -> dict:
        """The baseline's last JSON line, or `failed` with its earliest error."""
        started = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(self.work)})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {**failed, "error": _first_error(proc.stderr)}
        return self.emit({**row, "wall_s": round(time.monotonic() - started)})

    def worker(self, name: str, spec: dict, nproc: int, timeout_s: float | None = None) -> tuple[dict, list[dict]]:
        """Runs the worker on `spec` in a new run directory `name`: ({wall_s, step_s, tokens_per_s,
        tokens_per_step, peak_mem_gib} of the timed steps, or {wall_s, error}; rank 0's train events).
        `timeout_s`: past it the run's process group is stopped and the run is an error."""
        run_dir = self.work / name
        run_dir.mkdir()  # each run's name is used once in a work directory that started empty
        (run_dir / "job.yaml").write_text(yaml.safe_dump(spec))
        if self.smoke:
            argv = torchrun_argv(nproc, "-m", "launcher.train", "--run-dir", str(run_dir))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        else:  # ranks beyond the GPUs share GPU 0, each its own NCCL host
            argv, env = shared_gpu_argv(nproc, run_dir, self.wrapper)
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            output = "".join(proc.communicate(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
            output = "".join(proc.communicate())
        finally:
            if proc.poll() is None:  # interrupted: the ranks go with it
                stop_group(proc)
        wall = round(time.monotonic() - started)
        events_file = run_dir / "events" / "rank-0.jsonl"
        events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
        train = [e for e in events if e["type"] == "train"]
        timed = [e for e in train if e["step"] > self.warm]
        if timed_out:
            return {"wall_s": wall, "error": f"timed out after {timeout_s:.0f} s"}, train
        if proc.returncode or len(timed) < 2:
            return {"wall_s": wall, "error": run_error(run_dir, output)}, train
        step_s = (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])
        tokens = sum(e["tokens"] for e in timed[1:]) / (len(timed) - 1)  # non-padding, every rank's
        return {"wall_s": wall, "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s),
                "tokens_per_step": tokens, "peak_mem_gib": round(max(e["mem_peak_gib"] for e in train), 2)}, train
