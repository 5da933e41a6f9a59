"""Ingest under load: synthetic agents for N GPUs (8 per node) at 1 Hz plus every rank's timing
event and rank 0's train event each second, fed as JSON lines through `Ingestor.feed` (as the SSH
readers do) into a SQLite file. Prints one JSON line: rows expected vs stored, feed time per
second of data, and sample-to-database latency (commit time minus sample time).

    python bench/telemetry_ingest.py [--gpus 512] [--ranks 64] [--seconds 120] [--db /tmp/x.db]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, select  # noqa: E402

from backend.store.db import make_engine  # noqa: E402
from backend.telemetry.ingest import Ingestor  # noqa: E402
from backend.store.telemetry_models import MetricSample, RunEvent  # noqa: E402

GPUS_PER_NODE = 8


def gpu_line(t: float, gpu: int, k: int) -> str:
    return json.dumps({"kind": "gpu", "t": t, "gpu": gpu, "util_pct": 90.0 + k % 7, "mem_util_pct": 40.0,
                       "mem_used_gib": 60.5, "mem_total_gib": 80.0, "power_w": 610.0, "energy_j": 1e6 + k,
                       "temp_c": 62.0, "sm_clock_mhz": 1980.0, "pcie_tx_mib_s": 120.0, "pcie_rx_mib_s": 80.0,
                       "nvlink_tx_mib_s": 9000.0, "nvlink_rx_mib_s": 9000.0, "run_pids": [1000 + gpu],
                       "run_procs_count": 1, "other_procs_count": 0, "run_mem_used_gib": 58.0})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--db", help="SQLite file (default: a temporary one, removed afterwards)")
    args = ap.parse_args()
    tmp = None
    if args.db is None:
        tmp = tempfile.TemporaryDirectory()
        args.db = os.path.join(tmp.name, "ingest.db")
    engine = make_engine(f"sqlite:///{args.db}")
    ing = Ingestor(engine)
    nodes = [f"node-{n:03d}" for n in range((args.gpus + GPUS_PER_NODE - 1) // GPUS_PER_NODE)]
    offsets = {r: 0 for r in range(args.ranks)}
    feed_s = []
    start = time.time()
    ing.feed("bench", nodes[0], json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 1, "rank": 0,
                                            "data": {"type": "start", "time": start, "world_size": args.ranks}}))
    offsets[0] = 1
    for k in range(args.seconds):
        tick = start + k + 1
        time.sleep(max(0.0, tick - time.time()))
        t = time.time()
        for g in range(args.gpus):
            ing.feed("bench", nodes[g // GPUS_PER_NODE], gpu_line(t, g % GPUS_PER_NODE, k))
        for node in nodes:
            ing.feed("bench", node, json.dumps({"kind": "host", "t": t, "cpu_pct": 35.0, "ram_used_gib": 300.0,
                                                "ram_total_gib": 2000.0}))
        for r in range(args.ranks):
            ev = {"type": "timing", "time": t, "rank": r, "step": k + 1, "step_time_s": 1.0,
                  "collective_wait_s": 0.2, "data_wait_s": 0.01}
            offsets[r] += 100
            ing.feed("bench", nodes[r * len(nodes) // args.ranks], json.dumps(
                {"kind": "event", "file": f"events/rank-{r}.jsonl", "offset": offsets[r], "rank": r, "data": ev}))
        offsets[0] += 200
        ing.feed("bench", nodes[0], json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": offsets[0],
                                                "rank": 0, "data": {"type": "train", "time": t, "step": k + 1,
                                                                    "loss": 2.0, "tokens_per_s": 1e6}}))
        feed_s.append(time.time() - t)
    ing.close()
    per_gpu = sum(1 for key in json.loads(gpu_line(0, 0, 0)) if key not in ("kind", "t", "gpu", "run_pids"))
    expected_samples = args.seconds * (args.gpus * per_gpu + len(nodes) * 3 + args.ranks * 3 + 2)
    expected_events = 1 + args.seconds * (args.ranks + 1)
    with engine.connect() as conn:
        samples = conn.execute(select(func.count()).select_from(MetricSample.__table__)).scalar()
        events = conn.execute(select(func.count()).select_from(RunEvent.__table__)).scalar()
    lat = sorted(ing.latencies)
    q = statistics.quantiles(lat, n=100)
    print(json.dumps({
        "bench": "telemetry_ingest", "gpus": args.gpus, "ranks": args.ranks, "seconds": args.seconds,
        "samples_expected": expected_samples, "samples_stored": samples,
        "events_expected": expected_events, "events_stored": events,
        "lost": expected_samples - samples + expected_events - events,
        "rows_per_s": round((samples + events) / args.seconds),
        "feed_s_per_tick_p50": round(statistics.median(feed_s), 3), "feed_s_per_tick_max": round(max(feed_s), 3),
        "latency_s_p50": round(q[49], 3), "latency_s_p95": round(q[94], 3), "latency_s_max": round(lat[-1], 3),
        "flushes": ing.stats["flushes"], "flush_errors": ing.stats["flush_errors"],
        "db_mib": round(os.path.getsize(args.db) / 2**20, 1),
        "load_avg_1m_at_end": os.getloadavg()[0], "cpus": os.cpu_count(),
    }))
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
