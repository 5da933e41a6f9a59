"""Agreement of the agent's NVML readings with `nvidia-smi --query-gpu`, taken at the same moment.

Run on a GPU machine (ideally with the GPUs busy: `--load` keeps every GPU busy with bf16
matmuls from a background process so utilisation is not trivially 0 vs 0):

    python bench/nvml_vs_smi.py [--rounds 20] [--load]

Prints one JSON line per round and GPU, then a summary line with the largest differences and
whether they are within the target (utilisation within 10 points, memory within 1%).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.telemetry.agent import GpuSampler  # noqa: E402

QUERY = "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu,clocks.sm"
LOAD = r"""
import sys, time, torch
xs = []
for i in range(torch.cuda.device_count()):
    a = torch.randn(8192, 8192, device=f"cuda:{i}", dtype=torch.bfloat16)
    xs.append((a, a.clone()))
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for a, b in xs:
        a @ b
"""


def smi() -> dict[int, dict[str, float]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.strip().splitlines():
        idx, util, used, total, power, temp, sm = [p.strip() for p in line.split(",")]
        num = lambda s: float(s) if s not in ("[N/A]", "N/A", "") else None  # noqa: E731
        rows[int(idx)] = {"util_pct": num(util), "mem_used_gib": num(used) / 1024, "mem_total_gib": num(total) / 1024,
                          "power_w": num(power), "temp_c": num(temp), "sm_clock_mhz": num(sm)}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--load", action="store_true", help="keep every GPU busy while measuring (needs torch)")
    args = ap.parse_args()
    sampler = GpuSampler()
    if sampler.count == 0:
        print(json.dumps({"error": "; ".join(sampler.notices) or "no GPUs"}))
        return 1
    load = None
    if args.load:
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.rounds * args.interval + 30)])
        time.sleep(10)  # let the load reach every GPU
    worst = {"util_points": 0.0, "mem_pct": 0.0}
    try:
        for r in range(args.rounds):
            # NVML's utilisation is an average over the driver's last sample period, the same
            # source nvidia-smi reads; take both back to back
            ours = {s["gpu"]: s for s in sampler.sample(time.time(), set())}
            theirs = smi()
            for gpu, s in ours.items():
                o = theirs[gpu]
                du = abs(s.get("util_pct", float("nan")) - o["util_pct"])
                dm = abs(s.get("mem_used_gib", float("nan")) - o["mem_used_gib"]) / o["mem_total_gib"] * 100
                worst["util_points"] = max(worst["util_points"], du)
                worst["mem_pct"] = max(worst["mem_pct"], dm)
                print(json.dumps({"round": r, "gpu": gpu, "nvml": {k: s.get(k) for k in o}, "smi": o,
                                  "util_diff_points": round(du, 2), "mem_diff_pct_of_total": round(dm, 3)}))
            time.sleep(args.interval)
    finally:
        if load is not None:
            load.terminate()
            load.wait()
    print(json.dumps({"summary": True, "gpus": sampler.count, "rounds": args.rounds,
                      "max_util_diff_points": round(worst["util_points"], 2),
                      "max_mem_diff_pct": round(worst["mem_pct"], 3),
                      "switched_off": sorted(f"gpu{g}:{m}" for g, m in sampler.off),
                      "ok": worst["util_points"] <= 10 and worst["mem_pct"] <= 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
