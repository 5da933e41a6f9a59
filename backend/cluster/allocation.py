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

from backend.cluster.preflight import (PROBE_PY, TOKEN_DIR, CheckResult, PreflightReport, allocation_params,
                                      evaluate_allocation)
from backend.job.spec import load_spec

FAILED = 3


def report_dir(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / "preflight" / f"attempt-{int(attempt)}"


def probe(run_dir: str, where: Path, token: str, node: str) -> int:
    """This node's probe into the report directory. A node that cannot write there does not see the
    run directory the first node made: that is the judge's to say (a missing report), not a
    failure of the step that would keep the judge from running."""
    spec, _ = load_spec(Path(run_dir) / "job.yaml")  # unreadable: the judge says so
    params = allocation_params(str(Path(run_dir).parent), token, spec)
    out = subprocess.run([sys.executable, "-c", PROBE_PY, json.dumps(params)], capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    # The write test's token is this node's own (its name is in it): removed here, on the node,
    # where the output directory may be a disk of its own.
    tokens = Path(params["output_dir"]) / TOKEN_DIR
    for path in (tokens / token, tokens):
        try:
            path.unlink() if path.name == token else path.rmdir()
        except OSError:
            pass  # never written, or other nodes' tokens are still there
    if out.returncode != 0:
        return out.returncode
    try:
        (where / f"{node}.json").write_text(out.stdout)
    except OSError as exc:
        print(f"swift-studio pre-flight: node {node} cannot write its report into {where}: {exc}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="backend.cluster.allocation", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("probe", "judge"))
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--token", required=True, help="with the node's name, the file name a probe writes to test "
                        "the output directory")
    parser.add_argument("--node", help="probe: this node's name")
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("nodes", nargs="*", help="judge: every node of the allocation")
    args = parser.parse_intermixed_args(argv)  # the nodes come after the options
    where = report_dir(args.run_dir, args.attempt)
    if args.command == "probe":
        return probe(args.run_dir, where, f"{args.token}-{args.node}", args.node)
    if not args.nodes:
        report = PreflightReport([CheckResult("allocation", "nodes", "error",
                                              "Slurm listed no node of the allocation (scontrol show hostnames "
                                              "$SLURM_JOB_NODELIST)", "check the partition's nodes: sinfo -N")])
        (where / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
        print(report.text(), file=sys.stderr)
        return FAILED
    spec, problems = load_spec(Path(args.run_dir) / "job.yaml")
    if spec is None:
        print(f"swift-studio: {args.run_dir}/job.yaml: {'; '.join(map(str, problems))}", file=sys.stderr)
        return FAILED
    found: dict[str, dict | None] = {}
    for node in args.nodes:
        try:
            found[node] = json.loads((where / f"{node}.json").read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            found[node] = None
    report = PreflightReport(evaluate_allocation(found, spec, args.gpus_per_node))
    (where / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    print(report.text(), file=sys.stderr)
    return 0 if report.ok else FAILED


if __name__ == "__main__":
    sys.exit(main())
