"""Streaming (`streaming: true`) a JSONL larger than this machine's memory: time to the first
step, resident memory as the steps go, and a resume from a saved position.

Generates a file of `--gib` GiB of chat samples (data_scale.py's `short` shape, a block of 20,000
distinct ones written over and over; deleted after), then in a fresh process does what one rank of a
`--ranks`-rank data-parallel job does: `open_stream`, then `StreamBatches.step` for `--steps` steps
(`--packing`: rows packed on the fly), printing the seconds to the first step, samples/s and the
resident memory above the same process right after its imports at a few steps. Then a second
process restores the position saved after the last step and takes one more step: the seconds that
costs (datasets re-reads the file up to the saved record, without tokenizing it), and how fast the
reader goes through a GiB of the file without tokenizing (what a resume further in re-reads).

    python bench/stream_scale.py [--gib 20] [--steps 2000] [--ranks 8] [--packing]

One JSON line per phase; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import ROOT, write_chats  # noqa: E402

RANK = r"""
import json, sys, time
from pathlib import Path
import psutil
from transformers import AutoTokenizer
from backend.job.spec import JobSpec
from launcher.stream import StreamBatches, load_position, open_stream, save_position
args = json.loads(sys.argv[1])
proc = psutil.Process()
spec = JobSpec(**args["spec"])
tok = AutoTokenizer.from_pretrained(args["model"])
base = proc.memory_info().rss
t0 = time.perf_counter()
batches = StreamBatches(open_stream(spec, tok, 0, args["ranks"]), args["ranks"], args["micro"], 1, tok.pad_token_id,
                        spec.packing, spec.max_length)
first = args["first"]
if first:
    load_position(batches, first, Path(args["dir"]), 0)
marks = {first, first + 1, first + 10, first + 100, first + 1000} | {first + args["steps"] - 1}
samples = 0
for step in range(first, first + args["steps"]):
    micro = batches.step(step)
    assert micro is not None, batches.error
    samples += sum(m[2] for m in micro)
    if step == first:
        first_s = time.perf_counter() - t0
        t1 = time.perf_counter()
    if step in marks:
        print(json.dumps({"phase": "resume" if first else "stream", "step": step + 1,
                          "rss_above_imports_mib": round((proc.memory_info().rss - base) / 2**20, 1)}), flush=True)
elapsed = time.perf_counter() - t1
save_position(batches, first + args["steps"] - 1, Path(args["dir"]), 0)
print(json.dumps({"phase": "resume" if first else "stream", "first_step_s": round(first_s, 2),
                  "samples_per_s": round(samples / max(elapsed, 1e-9)), "records_read": batches.records,
                  "buffered": len(batches.buffer)}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8, help="rows per step")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-scale-", dir=args.dir))
    try:
        block = work / "block.jsonl"
        write_chats(block, 20_000, "short")
        chunk = block.read_bytes()
        data = work / "chats.jsonl"
        with open(data, "wb") as f:
            while f.tell() < args.gib * 2**30:
                f.write(chunk)
        print(json.dumps({"file_gib": round(data.stat().st_size / 2**30, 2), "load_avg": os.getloadavg()[0],
                          "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}),
              flush=True)
        spec = dict(model="m", dataset=[str(data)], streaming=True, max_steps=10**9, max_length=args.max_length,
                    packing=args.packing)
        model = str(ROOT / "assets" / "demo" / "model")
        for first in (0, args.steps):
            run = dict(spec=spec, model=model, ranks=args.ranks, micro=args.micro, steps=args.steps if not first else 1,
                       first=first, dir=str(work))
            out = subprocess.run([sys.executable, "-c", RANK, json.dumps(run)], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode:
                sys.exit(f"the rank process failed:\n{out.stderr[-3000:]}")
            print(out.stdout, end="", flush=True)
        # A resume re-reads the file up to its saved record without tokenizing: how fast that goes.
        from backend.job.records import Source, streamed_entries

        gib = min(1.0, args.gib)
        t0, read = time.perf_counter(), 0
        for _, raw in streamed_entries(Source(str(data)), 2**24):
            read += len(raw)
            if read >= gib * 2**30:
                break
        print(json.dumps({"phase": "re-read", "gib": gib, "gib_per_s": round(gib / (time.perf_counter() - t0), 3)}),
              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
