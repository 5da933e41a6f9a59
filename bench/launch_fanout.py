"""Fan-out of the control plane on 16 loopback SSH nodes (127.0.0.2 … 127.0.0.17, real OpenSSH):

* pre-flight without the bandwidth test: every check on every node, cold connections;
* launch: `RunManager.launch` of a 16-node job until the run is `running` (validation, login
  check, rendezvous port, run-directory files, every node's torchrun started detached), cold
  connections; the run is stopped right after (its workers never get far).

    python bench/launch_fanout.py [--nodes 16] [--repeat 3]

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

from backend.cluster import Cluster, Node  # noqa: E402
from backend.manager import RunManager  # noqa: E402
from backend.spec import JobSpec  # noqa: E402
from sshd import start_cluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        servers = start_cluster(root / "ssh", args.nodes)
        try:
            nodes = tuple(Node(host=s.host, slots=1, ssh_port=s.port, ssh_user="root", ssh_key=str(servers.key),
                               python=sys.executable, device="cpu") for s in servers.servers)
            cluster = Cluster(nodes)
            setups = {n.host: servers.setup for n in nodes}
            model = ROOT / "assets" / "demo" / "model"
            spec = JobSpec(model=str(model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                           output_dir=str(root / "out"), nnodes=args.nodes, nproc_per_node=1, max_steps=5,
                           torch_dtype="float32", env={"OMP_NUM_THREADS": "1"})
            db = f"sqlite:///{root / 'bench.db'}"
            pre, launch = [], []
            for _ in range(args.repeat):
                with RunManager(db, known_hosts=servers.known_hosts) as m:
                    t = time.perf_counter()
                    report = m.preflight(cluster, spec, setups=setups, bandwidth=False)
                    pre.append(time.perf_counter() - t)
                    if not report.ok:
                        print(report.text())
                        return 1
                with RunManager(db, known_hosts=servers.known_hosts) as m:
                    t = time.perf_counter()
                    run_id = m.launch(spec, cluster, setups=setups)
                    run = m.wait(run_id, timeout=60, states=("running", "failed", "stopped", "succeeded"))
                    launch.append(time.perf_counter() - t)
                    if run.state != "running":
                        print(f"launch ended {run.state}: {run.message}")
                        return 1
                    m.stop(run_id, grace_s=2)
                time.sleep(3)  # let the machine calm down between rounds
            print(f"nodes: {args.nodes} loopback OpenSSH servers, {len(report.results)} pre-flight checks")
            print(f"pre-flight (no bandwidth test), cold connections: median {statistics.median(pre):.2f} s "
                  f"(runs: {', '.join(f'{x:.2f}' for x in pre)}); target <= 5 s")
            print(f"launch until running, cold connections: median {statistics.median(launch):.2f} s "
                  f"(runs: {', '.join(f'{x:.2f}' for x in launch)}); target <= 2 s")
        finally:
            servers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
