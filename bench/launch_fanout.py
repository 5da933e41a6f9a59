"""Fan-out of the control plane on 16 loopback SSH nodes (127.0.0.2 … 127.0.0.17, real OpenSSH):

* pre-flight without the bandwidth test: every check on every node, cold connections;
* launch: `RunManager.launch` of a 16-node job until the run is `running` (validation, login
  check, rendezvous port, run-directory files, every node's torchrun started detached), measured
  warm (right after the pre-flight, as the studio's Launch button does) and cold (a fresh
  manager); each run is stopped right after (its workers never get far).

    python bench/launch_fanout.py [--nodes 16] [--repeat 3] [--plain-shell] [--standin]

`--standin` replaces the planner's torchrun by `sleep` (the same detached start, pid files, run
directory files): the figure is then the control plane alone, without 16 torchruns importing
torch on the same 2 cores while the remaining nodes are being started.

`--plain-shell` sets `SetEnv SHLVL=1` on the test servers so bash does not source the login
user's ~/.bashrc for SSH commands (here root's pyenv init costs ~0.45 s of CPU per SSH command):
the figures then measure swift-studio rather than this machine's shell start-up.

Targets on the 2-core machine: pre-flight ≤ 5 s, launch ≤ 2 s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from backend.job.cluster import Cluster  # noqa: E402
from backend.runs.manager import LaunchPlan, RunManager, default_planner  # noqa: E402
from backend.job.spec import JobSpec  # noqa: E402
from sshd import start_cluster  # noqa: E402


def standin_planner(spec, cluster, req) -> LaunchPlan:
    plan = default_planner(spec, cluster, req)
    return LaunchPlan(plan.files, [(["sleep", "60"], env) for _, env in plan.commands], plan.summary)


def timed_launch(m: RunManager, spec: JobSpec, cluster: Cluster, setups: dict) -> float:
    t = time.perf_counter()
    run_id = m.launch(spec, cluster, setups=setups)
    run = m.wait(run_id, timeout=120, states=("running", "failed", "stopped", "succeeded"))
    took = time.perf_counter() - t
    if run.state != "running":
        raise SystemExit(f"launch ended {run.state}: {run.message}")
    m.stop(run_id, grace_s=2)
    return took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--plain-shell", action="store_true", help="SetEnv SHLVL=1 on the servers (no ~/.bashrc per command)")
    ap.add_argument("--standin", action="store_true", help="start `sleep` instead of torchrun")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        servers = start_cluster(root / "ssh", args.nodes, extra_config="SetEnv SHLVL=1\n" if args.plain_shell else "")
        try:
            nodes, setups = servers.nodes(), servers.setups()
            cluster = Cluster(nodes)
            spec = JobSpec(model=str(ROOT / "assets" / "demo" / "model"),
                           dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                           output_dir=str(root / "out"), nnodes=args.nodes, nproc_per_node=1, max_steps=5,
                           torch_dtype="float32", env={"OMP_NUM_THREADS": "1"})
            db = f"sqlite:///{root / 'bench.db'}"
            planner = standin_planner if args.standin else None
            pre, warm, cold = [], [], []
            for _ in range(args.repeat):
                with RunManager(db, known_hosts=servers.known_hosts, planner=planner) as m:
                    t = time.perf_counter()
                    report = m.preflight(cluster, spec, setups=setups, bandwidth=False)
                    pre.append(time.perf_counter() - t)
                    if not report.ok:
                        print(report.text())
                        return 1
                    warm.append(timed_launch(m, spec, cluster, setups))
                time.sleep(3)  # the stopped workers' processes exit
                with RunManager(db, known_hosts=servers.known_hosts, planner=planner) as m:
                    cold.append(timed_launch(m, spec, cluster, setups))
                time.sleep(3)
            with open("/proc/loadavg") as f:
                load = f.read().split()[:3]
            print(f"nodes: {args.nodes} loopback OpenSSH servers{' (SetEnv SHLVL=1)' if args.plain_shell else ''}"
                  f"{', stand-in worker (sleep)' if args.standin else ', real torchrun'}, "
                  f"{len(report.results)} pre-flight checks; load average after: {' '.join(load)}")
            for label, values, target in (("pre-flight (no bandwidth test), cold connections", pre, 5),
                                          ("launch until running, after pre-flight (warm)", warm, 2),
                                          ("launch until running, fresh manager (cold)", cold, 2)):
                print(f"{label}: median {statistics.median(values):.2f} s "
                      f"(runs: {', '.join(f'{x:.2f}' for x in values)}); target <= {target} s")
        finally:
            servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
