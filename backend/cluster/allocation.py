"""The pre-flight inside a Slurm allocation. The batch script runs `probe` on every node (the SSH
pre-flight's node probe, `PROBE_PY`, into `preflight/attempt-<n>/<node>.json` of the shared run
directory), then `judge` on the allocation's first node: the same checks as on SSH nodes
(`backend.cluster.preflight.evaluate_allocation`), written to `preflight/attempt-<n>/report.json`
for the studio, exit 3 when one fails, before any worker starts.

    python -m backend.cluster.allocation probe --run-dir DIR --attempt N --token T --node NODE
    python -m backend.cluster.allocation judge --run-dir DIR --attempt N --token T --gpus-per-node G NODE...
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from backend.cluster.preflight import PROBE_PY, TOKEN_DIR, PreflightReport, allocation_params, evaluate_allocation
from backend.job.spec import absolute_dir, load_spec

FAILED = 3


def report_dir(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / "preflight" / f"attempt-{int(attempt)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="backend.cluster.allocation", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("probe", "judge"))
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--token", required=True, help="the file name the probes write to test the output directory")
    parser.add_argument("--node", help="probe: this node's name")
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("nodes", nargs="*", help="judge: every node of the allocation")
    args = parser.parse_intermixed_args(argv)  # the nodes come after the options
    where = report_dir(args.run_dir, args.attempt)
    if args.command == "probe":
        params = allocation_params(str(Path(args.run_dir).parent), args.token)
        out = subprocess.run([sys.executable, "-c", PROBE_PY, json.dumps(params)], capture_output=True, text=True)
        sys.stderr.write(out.stderr)
        if out.returncode == 0:
            (where / f"{args.node}.json").write_text(out.stdout)
        return out.returncode
    spec, problems = load_spec(Path(args.run_dir) / "job.yaml")
    if spec is None:
        print(f"swift-studio: {args.run_dir}/job.yaml: {'; '.join(map(str, problems))}", file=sys.stderr)
        return FAILED
    where = report_dir(args.run_dir, args.attempt)
    found: dict[str, dict | None] = {}
    for node in args.nodes:
        try:
            found[node] = json.loads((where / f"{node}.json").read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            found[node] = None
    # The probes' write test left this token in the output directory: ours to remove.
    tokens = Path(absolute_dir(spec.output_dir)) / TOKEN_DIR
    for path in (tokens / args.token, tokens):
        try:
            path.unlink() if path.name == args.token else path.rmdir()
        except OSError:
            pass  # gone already, or another run's tokens are still there
    report = PreflightReport(evaluate_allocation(found, spec, args.gpus_per_node))
    (where / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    print(report.text(), file=sys.stderr)
    return 0 if report.ok else FAILED


if __name__ == "__main__":
    sys.exit(main())
