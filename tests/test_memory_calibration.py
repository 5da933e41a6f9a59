"""The per-GPU memory estimate against the peaks measured on GPUs (issue 36): every recorded row of
the calibration benchmarks (bench/calibration.py rebuilds each row's job as the benchmark wrote it)
holds the estimate within 10% of its measured peak, but the cases it is known to miss, each held to
the error it had when recorded here. A change of backend.job.memory that breaks a calibrated case
fails here, without a GPU; one that brings a known miss within 10% passes (then drop it below)."""
from __future__ import annotations

import sys

from worker import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from calibration import recorded_cases  # noqa: E402

# The benchmarks that measure the estimate's layouts on the current worker (older suite results
# measured a worker since changed).
CALIBRATION_FILES = ("h200-layout-memory.jsonl", "h200-dpo-1.jsonl", "h100-dpo-2.jsonl", "h200-long-context-8b.jsonl",
                     "h200-moe.jsonl", "h100-vl-1.jsonl", "h100-vl-2.jsonl",
                     "h100-dpo-3.jsonl", "h200-dpo-2.jsonl", "h100-advisor-1.jsonl", "h100-lora-engines.jsonl")
# Recorded row: (the estimate's error there, why it misses). docs/benchmarks.md has the table.
KNOWN_MISSES = {
    "h200-layout-memory.jsonl:3": (0.218, "ZeRO-2: high with and without SP, the cause not yet found"),
    "h200-layout-memory.jsonl:4": (0.205, "ZeRO-2 under Ulysses SP, as above"),
    "h200-dpo-1.jsonl:3": (0.137, "LoRA DPO, eager: high, not yet fitted"),
    "h200-dpo-1.jsonl:4": (0.478, "LoRA DPO compiled: the estimate counts what eager keeps"),
    "h200-dpo-1.jsonl:8": (0.132, "full DPO on ZeRO-3: high, not yet fitted"),
    "h200-long-context-8b.jsonl:20": (-0.117, "torch_compile keeps more than eager at 64K, not fitted"),
    "h200-long-context-8b.jsonl:25": (-0.135, "torch_compile at 128K, as above"),
    "h200-moe.jsonl:1": (-0.126, "transformers' MoE block keeps more per routed token without checkpointing"),
    "h200-moe.jsonl:3": (-0.164, "the MoE block, as above, under LoRA"),
    "h100-vl-1.jsonl:3": (-0.112, "Qwen2.5-VL-3B LoRA without Liger or checkpointing: low; the same job with the "
                                  "images' tokens as text peaks as high (h100-vl-2), so it is the language model's "
                                  "activations without Liger at this shape, not the tower"),
    "h100-vl-2.jsonl:2": (-0.112, "the same run as h100-vl-1.jsonl:3, again"),
    "h200-dpo-2.jsonl:3": (0.132, "full DPO on ZeRO-3, as h200-dpo-1.jsonl:8 (the same peak)"),
    # the advisor's held-out jobs on an H100 (bench/advisor.py) and the LoRA engines' calibration run
    "h100-advisor-1.jsonl:1": (0.195, "Qwen2.5-0.5B full, Liger, no checkpointing, 8 x 4096: high on every engine, "
                                      "not yet fitted (with checkpointing the same job is within 5%)"),
    "h100-advisor-1.jsonl:2": (0.190, "as h100-advisor-1.jsonl:1, on FSDP2"),
    "h100-advisor-1.jsonl:3": (0.194, "as h100-advisor-1.jsonl:1, on ZeRO-1"),
    "h100-advisor-1.jsonl:4": (0.194, "as h100-advisor-1.jsonl:1, on ZeRO-2"),
    "h100-advisor-1.jsonl:10": (0.126, "Qwen3-1.7B full on ZeRO-1: high, as ZeRO-2 elsewhere"),
    "h100-advisor-1.jsonl:11": (0.126, "Qwen3-1.7B full on ZeRO-2: high, as ZeRO-2 elsewhere"),
    "h100-advisor-1.jsonl:16": (0.102, "LoRA on FSDP2 with Liger at 8192: high, not yet fitted"),
    "h100-advisor-1.jsonl:17": (-0.167, "LoRA on DDP without Liger at 8192: low, not yet fitted"),
    "h100-advisor-1.jsonl:19": (0.114, "LoRA on ZeRO-2 with checkpointing and Liger: high, as ZeRO-2 elsewhere"),
    "h100-lora-engines.jsonl:2": (0.169, "LoRA on FSDP2 with Liger, as h100-advisor-1.jsonl:16"),
}
TOLERANCE = 0.10
DRIFT = 0.02  # how far a known miss may move before the test asks for a look


def test_the_estimate_holds_every_calibrated_gpu_measurement():
    cases = [c for c in recorded_cases() if c.where.split(":")[0] in CALIBRATION_FILES]
    assert len(cases) >= 30, [c.where for c in cases]
    assert set(KNOWN_MISSES) <= {c.where for c in cases}, "a known miss names no recorded row"
    wrong = []
    for case in cases:
        known, why = KNOWN_MISSES.get(case.where, (0.0, ""))
        limit = max(TOLERANCE, abs(known) + DRIFT)
        if abs(case.error) > limit:
            wrong.append(f"{case.where} {case.name}: estimate {case.estimate_gib:.2f} GiB vs measured "
                         f"{case.measured_gib:.2f} ({case.error:+.1%}, allowed ±{limit:.0%}{'; ' + why if why else ''})")
    assert not wrong, "\n".join(wrong)
