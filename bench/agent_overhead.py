"""Cost of the node agent on training throughput, measured in one run.

A small causal LM trains on one GPU (cuda:0) in alternating phases without and with `python -m backend.agent` running at 1 Hz next to it (reading the GPUs, the
host, this process's event file, with its stdout consumed like the SSH channel). Alternating
(off, on, off, on, ...) cancels slow drift (clocks, temperature). Run on the GPU machine:

    python bench/agent_overhead.py [--phases 6] [--steps 60] [--hidden 2048] [--layers 12]

Prints one JSON line per phase and a summary line: tokens/s without and with the agent and the
relative cost (target: within 1%).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_agent(run_dir: Path, interval: float) -> tuple[subprocess.Popen, list[int]]:
    agent = subprocess.Popen([sys.executable, "-m", "backend.agent", "--run-id", "bench", "--run-dir", str(run_dir),
                              "--node", "bench", "--interval", str(interval)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = [0]

    def drain():
        for _ in agent.stdout:
            lines[0] += 1

    threading.Thread(target=drain, daemon=True).start()
    return agent, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=6, help="alternating phases (even: as many off as on)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per phase")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test of the script)")
    args = ap.parse_args()

    if "RANK" not in os.environ:
        # The agent learns the run's ranks from the workers' environment as torchrun sets it;
        # start again with it so this process is found as rank 0, as a worker would be.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "RANK": "0", "LOCAL_RANK": "0"})

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    run_dir = Path(tempfile.mkdtemp(prefix="agent-overhead-"))
    for d in ("events", "logs", "pids"):
        (run_dir / d).mkdir()
    (run_dir / "pids" / "bench.pid").write_text(str(os.getpgid(0)))
    events = open(run_dir / "events" / "rank-0.jsonl", "a", buffering=1)

    cfg = Qwen2Config(hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 128), num_key_value_heads=max(1, args.hidden // 512),
                      vocab_size=32000, max_position_embeddings=args.seq)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(5):  # warm-up
        step()
    sync()

    rates = {"off": [], "on": []}
    global_step = 0
    for p in range(args.phases):
        phase = "off" if p % 2 == 0 else "on"
        agent = lines = None
        if phase == "on":
            agent, lines = start_agent(run_dir, args.interval)
            time.sleep(2 * args.interval)  # past its start-up
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
            global_step += 1
            if global_step % 5 == 0:  # the worker's own event lines, for the agent to tail
                events.write(json.dumps({"type": "train", "time": time.time(), "step": global_step,
                                         "loss": loss.item()}) + "\n")
        sync()
        dt = time.perf_counter() - t0
        tps = args.steps * args.batch * args.seq / dt
        rates[phase].append(tps)
        rec = {"phase": p, "agent": phase, "tokens_per_s": round(tps, 1), "seconds": round(dt, 2)}
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=10)
            rec["agent_lines"] = lines[0]
        print(json.dumps(rec), flush=True)

    off, on = statistics.fmean(rates["off"]), statistics.fmean(rates["on"])
    cost = (off - on) / off * 100
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(json.dumps({"summary": True, "device": device, "tokens_per_s_off": round(off, 1),
                      "tokens_per_s_on": round(on, 1), "cost_pct": round(cost, 3),
                      "phase_spread_pct": round((max(rates["off"]) - min(rates["off"])) / off * 100, 3),
                      "ok": cost <= 1.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
