"""The memory estimate against every recorded GPU measurement: each row of bench/results/ that
holds a worker run's measured peak (allocated memory, without the CUDA context), its job rebuilt as
the benchmark that measured it wrote it (bench/layout_memory.py, bench/throughput.py, bench/dpo.py,
bench/vl.py, bench/advisor.py), and backend.job.memory's estimate for that job now.
tests/test_memory_calibration.py holds the estimate to these rows; this prints the table:

    python bench/calibration.py
"""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import advisor  # noqa: E402
import dpo  # noqa: E402
import layout_memory  # noqa: E402
import vl  # noqa: E402
from throughput import SHAPES, estimated_gib, job_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# What a throughput or DPO row records beside its job's own fields.
MEASURED = {"source", "model", "seq", "bsz", "lora", "liger", "nproc", "mixed_lengths", "agent", "wall_s", "step_s",
            "tokens_per_s", "estimated_gib", "useful_tokens_per_s", "mfu", "peak_mem_gib", "moe_aux_loss",
            "moe_max_expert_share", "name", "tokens_per_pair", "losses", "margins", "logps_chosen",
            "rewards_accuracies", "transformers", "tokens_per_sample", "shape"}


@dataclass(frozen=True)
class Case:
    where: str  # file:line of the recorded row
    name: str
    measured_gib: float
    estimate_gib: float  # the estimate for its job now

    @property
    def error(self) -> float:
        """Estimate over measurement, less one: +0.10 is 10% high."""
        return self.estimate_gib / self.measured_gib - 1


def _config(shape: str, row: dict) -> dict | None:
    """The model's config.json where the row's run did not use its shape's own: bench/dpo.py's
    pipeline rows ("pp-...") ran the shape with its output layer untied from the embedding (a
    pipeline refuses a tied one), so each stage of two holds one of the two."""
    if row.get("source") == "swift-studio" and str(row.get("name", "")).startswith("pp-"):
        return {**SHAPES[shape], "tie_word_embeddings": False}
    return vl.vl_config(shape) if shape in vl.SHAPES else None


def _job(row: dict) -> tuple[str, int, dict] | None:
    """(shape, ranks, job) the benchmark ran for a recorded row; None for a row that is no worker
    run with a measured peak, whose rows were of many lengths (the estimate is for rows at
    max_length: a padded batch of shorter ones peaks lower), or whose DeepSpeed config was a file."""
    if "error" in row:
        return None
    if "layout" in row and "peak_gib_rank0" in row:  # bench/layout_memory.py
        ranks, fields = layout_memory.LAYOUTS[row["layout"]]
        return row["shape"], ranks, job_spec(Path("model"), Path("data.jsonl"), row["seq"], 1, 4, liger=False,
                                             gradient_checkpointing=True, **fields)
    if "job" in row and "fields" in row:  # bench/advisor.py: its job as the user gave it, the advisor's fields over it
        if "peak_mem_gib" not in row:
            return None
        shape, train_type, seq, global_batch = advisor.JOBS[row["job"]]
        return shape, 1, {**advisor.user_job(Path("model"), Path("data.jsonl"), train_type, seq, global_batch, 4),
                          **row["fields"]}
    if row.get("source") != "swift-studio" or "peak_mem_gib" not in row or row.get("mixed_lengths"):
        return None
    if str(row.get("deepspeed", "")).endswith(".json"):  # a config file of the machine it ran on
        return None
    fields = {k: v for k, v in row.items() if k not in MEASURED}
    if "tokens_per_sample" in row:  # bench/vl.py (its rows before the Qwen3-VL shape name none)
        shape = row.get("shape", "qwen2.5-vl-3b")
        return shape, row["nproc"], vl.our_job(Path("model"), Path("images.jsonl"), row["seq"], vl.SHAPES[shape][3][1],
                                               row["bsz"], 10, "bfloat16", **fields)
    if "name" in row:  # bench/dpo.py
        if row["name"].startswith("spread-"):  # Bench.padding_free's pairs of many lengths
            return None
        return "qwen2.5-1.5b", row["nproc"], dpo.our_job(Path("model"), Path("pairs.jsonl"), row["seq"], row["bsz"], 10,
                                                         row["lora"], "bfloat16", **fields)
    return row["model"], row["nproc"], job_spec(Path("model"), Path("data.jsonl"), row["seq"], row["bsz"], 4,
                                                lora=row["lora"], liger=row["liger"], **fields)


def recorded_cases(results: Path = RESULTS) -> list[Case]:
    cases = []
    with tempfile.TemporaryDirectory() as work:
        for path in sorted(results.glob("*.jsonl")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                rebuilt = _job(json.loads(line))
                if rebuilt is None:
                    continue
                shape, ranks, job = rebuilt
                run_dir = Path(work) / f"{path.stem}-{number}"
                run_dir.mkdir()
                (run_dir / "job.yaml").write_text(yaml.safe_dump(job))
                row = json.loads(line)
                label = (f"{row['job']} #{row['rank']} {row['engine']}" if "job" in row else
                         row.get("name") or row.get("layout") or _label(row))
                cases.append(Case(f"{path.name}:{number}", label,
                                  row.get("peak_mem_gib", row.get("peak_gib_rank0")),
                                  estimated_gib(run_dir, shape, ranks, _config(shape, row))))
    return cases


def _label(row: dict) -> str:
    engine = row.get("deepspeed") or row.get("fsdp") or "ddp"
    extras = [k for k in ("torch_compile", "gradient_checkpointing", "tiled_mlp", "activation_cpu_offload", "packing")
              if row.get(k)]
    return (f"{row['model']} {row['seq']}x{row['bsz']} {'lora' if row['lora'] else 'full'} {engine}"
            f"{' liger' if row['liger'] else ''}{''.join(' ' + e for e in extras)} x{row['nproc']}")


def main() -> int:
    print("| recorded row | job | measured peak (GiB) | estimate now (GiB) | error |")
    print("|---|---|---|---|---|")
    for case in recorded_cases():
        print(f"| {case.where} | {case.name} | {case.measured_gib:.2f} | {case.estimate_gib:.2f} | {case.error:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
