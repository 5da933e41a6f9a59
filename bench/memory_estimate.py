"""Measured peak GPU memory of one training step vs `backend.job.memory.estimate_memory`.

Runs on one CUDA GPU the way the worker's torch-DDP single-rank path does (fp32 weights, or a bf16
LoRA base, autocast to bf16, AdamW fused, optional LoRA and gradient checkpointing), with a model
built from a bundled config (random weights; no download). The worker takes that path for LoRA and
for float16 full fine-tuning; bf16 full fine-tuning runs on FSDP2, whose peaks come from
bench/throughput.py's runs (tests/test_memory.py). Prints one JSON line per case:
    python -m bench.memory_estimate [--cases all]
`measured_gib` is torch.cuda.max_memory_allocated (no CUDA context), so it is compared with the
estimate's total minus `other_gib`.
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.job.layout import compute_layout
from backend.job.memory import estimate_memory
from backend.job.modelcfg import BUNDLED_DIR, load_model_config
from backend.job.spec import JobSpec
from launcher.engines.base import make_optimizer
from launcher.model import add_lora, master_dtype

CASES = [
    # model, train_type, micro-batch, max_length, gradient checkpointing
    ("qwen2.5-0.5b", "full", 1, 2048, True),
    ("qwen2.5-0.5b", "full", 4, 2048, True),
    ("qwen2.5-0.5b", "full", 2, 2048, False),
    ("qwen2.5-0.5b", "lora", 4, 4096, True),
    ("qwen2.5-1.5b", "full", 2, 4096, True),
    ("llama3.2-1b", "lora", 2, 4096, False),
    ("qwen2.5-7b", "lora", 1, 4096, True),
]


def measure(name: str, train_type: str, micro: int, max_length: int, checkpointing: bool) -> dict:
    # float16 selects torch DDP's path for full fine-tuning, the one run here (same widths as the
    # bf16 autocast below; the weights are fp32 either way)
    spec = JobSpec(model=name, dataset=["d"], train_type=train_type, per_device_train_batch_size=micro,
                   max_length=max_length, gradient_checkpointing=checkpointing, nproc_per_node=1,
                   torch_dtype="bfloat16" if train_type == "lora" else "float16")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = AutoConfig.from_pretrained(BUNDLED_DIR / f"{name}.json")
    model = AutoModelForCausalLM.from_config(config, dtype=master_dtype(spec), attn_implementation="sdpa").cuda()
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if train_type == "lora":
        model = add_lora(model, spec)
        if checkpointing:
            model.enable_input_require_grads()
    optimizer = make_optimizer(model, spec, torch.device("cuda"))
    ids = torch.randint(0, config.vocab_size, (micro, max_length), device="cuda")
    for _ in range(2):  # the second step has the optimizer states allocated
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated() / 2**30
    est = estimate_memory(spec, load_model_config(BUNDLED_DIR / f"{name}.json"), compute_layout(spec))
    del model, optimizer, ids, loss
    predicted = est.total_gib - est.other_gib
    return {"model": name, "train_type": train_type, "micro": micro, "max_length": max_length,
            "gradient_checkpointing": checkpointing, "measured_gib": round(measured, 2),
            "estimated_gib": round(predicted, 2), "error_pct": round(100 * (predicted / measured - 1), 1),
            "estimate": est.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    args = parser.parse_args()
    for case in CASES[: args.cases]:
        print(json.dumps(measure(*case)), flush=True)


if __name__ == "__main__":
    main()
