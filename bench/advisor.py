"""Issue 36's advisor target on one GPU: for jobs whose shapes and lengths did not tune the cost model,
the configurations the layout advisor gives (backend.job.advisor.advise, every fitting row) are run
on the worker in the same call; its first pick's tokens/s against the best measured, and whether any
measured configuration, the pick above all, ran out of memory.

    python bench/advisor.py --out advisor.jsonl                        # GPU: the three jobs
    python bench/advisor.py --jobs qwen2.5-0.5b-full-4k --runs 8       # one job, at most 8 configurations
    python bench/advisor.py --smoke                                    # CPU, a tiny model: the pipeline end to end
    python bench/advisor.py --jobs llama3.2-3b-lora-8k --rows 0:12 --out a.jsonl   # rows 0..11 of the advisor's
    python bench/advisor.py --jobs llama3.2-3b-lora-8k --rows 12:24 --out b.jsonl  # order, then the rest
    python bench/advisor.py --merge a.jsonl b.jsonl                    # one job line over both

--rows (rows N and slices START:STOP, comma-separated: `--rows 0,7:9`) splits a job too long for one
device call (600 s) over calls on the same warm machine, or measures the first pick beside chosen rows
in one call; --merge
refuses lines from different hosts or GPUs, rows measured twice or beyond the job's, rows of a job no
call finished, and an --out that is one of its inputs.

Without --rows, --runs N measures every configuration when the advisor gives at most N; otherwise its first N - N//2
by prediction and N//2 spread evenly over the rest, the slowest predicted included (each job's line
says how many of how many). A row line per run: the advisor's rank, fields and predictions beside the
measured tokens/s and peak; then the job's line: the pick's tokens/s over the best measured (target
>= 0.9), the rank correlation of predicted and measured tokens/s, and the runs out of memory.

The data: random-token samples of exactly max_length tokens (the advisor is told that length), a
global batch of the job's per step; `--steps` steps a run, the first `--warm` untimed."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Compared  # noqa: E402
from throughput import SHAPES, build_model_dir, estimated_gib, job_spec, write_tokens  # noqa: E402

# name: (shape, train_type, max_length, global batch). Not the shapes and lengths BASE_MFU and
# ENGINE_EFFICIENCY were measured on (Qwen2.5-1.5B at 2048, Llama-3.2-1B at 4096).
JOBS = {
    "qwen2.5-0.5b-full-4k": ("qwen2.5-0.5b", "full", 4096, 16),
    "qwen3-1.7b-full-2k": ("qwen3-1.7b", "full", 2048, 16),
    "llama3.2-3b-lora-8k": ("llama3.2-3b", "lora", 8192, 8),
}
SMOKE_JOB = ("smoke", "full", 64, 4)
TARGET = 0.9


def chosen(n_rows: int, runs: int) -> list[int]:
    """The indices of the rows to measure (see the module docstring)."""
    if n_rows <= runs:
        return list(range(n_rows))
    head, spread = runs - runs // 2, runs // 2
    rest = list(range(head, n_rows))
    # evenly from the fastest predicted of the rest to the slowest (one: the slowest)
    picks = [rest[len(rest) - 1 - round(i * (len(rest) - 1) / max(spread - 1, 1))] for i in range(spread)]
    return list(range(head)) + sorted(set(picks))


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (ties given their mean rank); None under three points."""
    if len(xs) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return round(cov / spread, 3) if spread else None


def user_job(model_dir: Path, data: Path, train_type: str, seq: int, global_batch: int, steps: int,
             dtype: str = "bfloat16") -> dict:
    """A job of JOBS as a user would start it (one sample a micro-batch); the advisor varies the rest."""
    return job_spec(model_dir, data, seq, 1, steps, lora=train_type == "lora", liger=False, dtype=dtype,
                    gradient_accumulation_steps=global_batch)


def out_of_memory(error: str) -> bool:
    return "out of memory" in error.lower() or "OutOfMemoryError" in error


class Bench(Compared):
    run_timeout_s: float | None = None

    def job(self, name: str, shape: str, train_type: str, seq: int, global_batch: int, runs: int,
            row_list: list[int] | None = None) -> None:
        from backend.job.advisor import Hardware, advise
        from backend.job.modelcfg import parse_model_config
        from backend.job.spec import JobSpec

        dtype = "float32" if self.smoke else "bfloat16"
        model_dir = build_model_dir(shape, self.work / f"model-{shape}", dtype)
        data = self.work / f"{name}.jsonl"
        write_tokens(data, global_batch * (self.steps + 1), seq, SHAPES[shape]["vocab_size"])
        base = user_job(model_dir, data, train_type, seq, global_batch, self.steps, dtype)
        hardware = Hardware(gpu_mem_gib=80.0) if self.smoke else Hardware(gpu_mem_gib=gpu_mem_gib())
        advice = advise(JobSpec(**base), parse_model_config(SHAPES[shape], shape), None, hardware,
                        tokens_per_sample=seq, top=10**6)
        # Liger's Triton kernels do not run on the CPU
        rows = [r for r in advice.rows if not (self.smoke and r.fields.get("use_liger_kernel"))]
        measured, where = [], machine()
        picked = chosen(len(rows), runs) if row_list is None else [i for i in row_list if i < len(rows)]
        if row_list is not None and len(picked) < len(row_list):  # a slice past the end is how a split ends
            print(f"{name}: rows {[i for i in row_list if i >= len(rows)]} of --rows left out: the advisor gave "
                  f"{len(rows)} (0-{len(rows) - 1})", file=sys.stderr, flush=True)
        for index in picked:
            row = rows[index]
            spec = {**base, **row.fields}
            timing, _ = self.worker(f"{name}-{index}", spec, 1, timeout_s=self.run_timeout_s)
            timing.pop("tokens_per_step", None)
            line = {"job": name, "rank": index, **where, "engine": row.engine, "fields": row.fields,
                    "predicted_tokens_per_s": round(row.tokens_per_s), "predicted_memory_gib": round(row.memory_gib, 2),
                    **timing}
            if "error" in timing:
                line["out_of_memory"] = out_of_memory(timing["error"])
            else:
                line["estimated_gib"] = estimated_gib(self.work / f"{name}-{index}", shape, 1)
            measured.append(self.emit(line))
        self.emit(job_line(name, len(rows), advice.summary(), measured, where))


def machine() -> dict:
    """Which machine measured: lines merged from several calls must share it."""
    import socket

    import torch

    return {"host": socket.gethostname(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def job_line(name: str, enumerated: int, summary: str, measured: list[dict], where: dict) -> dict:
    """The job's verdict over its measured rows (the advisor's order: row 0 is its first pick)."""
    ran = [m for m in measured if "error" not in m]
    best = max(ran, key=lambda m: m["tokens_per_s"], default=None)
    pick = next((m for m in measured if m["rank"] == 0), None)
    ratio = (round(pick["tokens_per_s"] / best["tokens_per_s"], 3)
             if pick and best and "error" not in pick else None)
    return {"target": f"{name}: the advisor's first pick vs the best measured", "job": name, **where,
            "enumerated": enumerated, "measured": len(measured), "rows": sorted(m["rank"] for m in measured),
            "summary": summary, "pick": pick and {k: pick[k] for k in ("engine", "fields")},
            "best": best and {k: best[k] for k in ("rank", "engine", "fields", "tokens_per_s")},
            "ratio": ratio, "goal": TARGET,
            "met": ratio is not None and ratio >= TARGET and not pick.get("out_of_memory"),
            "out_of_memory": [m["rank"] for m in measured if m.get("out_of_memory")],
            "failed": [m["rank"] for m in measured if "error" in m and not m.get("out_of_memory")],
            "rank_correlation": rank_correlation([m["predicted_tokens_per_s"] for m in ran],
                                                 [m["tokens_per_s"] for m in ran])}


def merged(paths: list[Path]) -> list[dict]:
    """One job line per job over the row lines of `paths` (calls of --rows on one machine). Raises
    ValueError naming the file and line of what cannot be merged."""
    rows: dict[str, dict[int, tuple[str, dict]]] = {}
    jobs: dict[str, dict] = {}
    first_seen: dict[str, tuple[str, dict]] = {}
    for path in paths:
        for number, text in enumerate(path.read_text().splitlines(), 1):
            where = f"{path}:{number}"
            try:
                line = json.loads(text)
            except ValueError as e:
                raise ValueError(f"{where}: not a JSON line ({e})") from None
            if not (isinstance(line, dict) and isinstance(line.get("job"), str)
                    and ("target" in line or isinstance(line.get("rank"), int))):
                raise ValueError(f"{where}: not a line of bench/advisor.py (a row's or a job's JSON object)")
            there, first = first_seen.setdefault(line.get("job"), (where, line))
            for key in ("host", "device"):
                if line.get(key) != first.get(key):
                    raise ValueError(f"{where}: {key} {line.get(key)!r}, but {there} has {first.get(key)!r}: "
                                     "the lines of one job must come from one machine")
            if "target" in line:
                jobs.setdefault(line["job"], line)
            elif "rank" in line:
                seen = rows.setdefault(line["job"], {})
                if line["rank"] in seen:
                    raise ValueError(f"{where}: row {line['rank']} of {line['job']} again "
                                     f"(first at {seen[line['rank']][0]})")
                seen[line["rank"]] = (where, line)
    out = []
    for name, by_rank in rows.items():
        if name not in jobs:
            raise ValueError(f"{name}: row lines without the job's line (no call of it finished)")
        first = jobs[name]
        beyond = [rank for rank in by_rank if not 0 <= rank < first["enumerated"]]
        if beyond:
            raise ValueError(f"{by_rank[beyond[0]][0]}: row {beyond[0]} of {name}, "
                             f"which has rows 0-{first['enumerated'] - 1}")
        out.append(job_line(name, first["enumerated"], first["summary"],
                            [line for _, (_, line) in sorted(by_rank.items())],
                            {"host": first.get("host"), "device": first.get("device")}))
    return out


def row_list(text: str) -> list[int]:
    """The rows of `--rows`: comma-separated rows N and slices START:STOP (rows START..STOP-1)."""
    rows: set[int] = set()
    for item in text.split(","):
        start, colon, stop = item.partition(":")
        try:
            bounds = range(int(start), int(stop) if colon else int(start) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not a row N or a slice START:STOP of whole "
                                             "numbers") from None
        if bounds.start < 0 or not bounds:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r}: rows from 0, a slice's START < STOP")
        rows.update(bounds)
    return sorted(rows)


def gpu_mem_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help="of " + ", ".join(JOBS))
    parser.add_argument("--runs", type=int, default=8, help="configurations measured a job, at most")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds a run may take before it is stopped")
    parser.add_argument("--rows", type=row_list, help="the advisor's rows: N and START:STOP (rows START..STOP-1), "
                                                     "comma-separated (not --runs)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSONL", help="job lines over these files' rows")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", type=Path, default=Path("/dev/null"))
    args = parser.parse_args()
    if args.merge:
        # the same file by another name too (a symbolic or hard link)
        if args.out.exists() and any(path.exists() and args.out.samefile(path) for path in args.merge):
            parser.error(f"--out {args.out} is one of the files --merge reads: it would be overwritten")
        try:
            lines = merged(args.merge)
        except (OSError, ValueError) as e:
            parser.error(f"--merge: {e}")
        with open(args.out, "w") as out:
            for line in lines:
                print(json.dumps(line))
                out.write(json.dumps(line) + "\n")
        return 0
    names = args.jobs.split(",")
    unknown = set(names) - set(JOBS)
    if unknown:
        parser.error(f"--jobs: unknown {', '.join(sorted(unknown))} (choose from {', '.join(JOBS)})")
    if args.runs < 1:
        parser.error("--runs: at least 1")
    work = Path(tempfile.mkdtemp(prefix="advisor-bench-"))
    try:
        with open(args.out, "w") as out:
            bench = Bench(work, 4 if args.smoke else args.steps, 1 if args.smoke else args.warm, out, args.smoke)
            bench.run_timeout_s = args.run_timeout
            if args.smoke:
                bench.job("smoke", *SMOKE_JOB, min(args.runs, 3), args.rows)
            for name in [] if args.smoke else names:
                bench.job(name, *JOBS[name], args.runs, args.rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
