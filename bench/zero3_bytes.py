"""ZeRO-3 memory per parameter on one GPU: resident states, and the step's transient peak.

    torchrun --nproc_per_node 1 bench/zero3_bytes.py qwen2.5-0.5b     (on a GPU; bundled config name)

Prints one JSON line: bytes per parameter after init, and per step before forward, at the forward/
backward peak, after backward, at the step() peak and after the step. backend/job/memory.py's ZeRO-3
figures (16 held + the reduce bucket, plus step()'s sub-group transient) come from this script
(H200, DeepSpeed 0.19.8: qwen2.5-0.5b 18.16 held / 24.16 in step(); qwen2.5-1.5b 16.69 / 20.58).
"""
import json
import sys

import torch
import deepspeed
from transformers import AutoConfig, AutoModelForCausalLM
from backend.job.dsconfig import build_ds_config
from backend.job.modelcfg import BUNDLED_DIR
from backend.job.spec import JobSpec

name = sys.argv[1]
spec = JobSpec(model=name, dataset=["d"], train_type="full", deepspeed="zero3", nproc_per_node=1,
               per_device_train_batch_size=1, max_length=128)
config = build_ds_config(spec, 1, AutoConfig.from_pretrained(BUNDLED_DIR / f"{name}.json").hidden_size)
config["bf16"] = {"enabled": True}
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BUNDLED_DIR / f"{name}.json"), dtype=torch.float32)
model.config.use_cache = False
P = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
deepspeed.init_distributed()
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
G = 2**30
ids = torch.randint(0, 1000, (1, 128), device="cuda")
rows = {"model": name, "params": P, "sub_group_size": config["zero_optimization"].get("sub_group_size"),
        "reduce_bucket": config["zero_optimization"].get("reduce_bucket_size"),
        "after_init": torch.cuda.memory_allocated() / P}
for step in range(3):
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    torch.cuda.synchronize(); after_bwd = torch.cuda.memory_allocated(); peak_fb = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.step()
    torch.cuda.synchronize(); peak_step = torch.cuda.max_memory_allocated(); after = torch.cuda.memory_allocated()
    rows[f"step{step}"] = {k: round(v / P, 3) for k, v in dict(before=before, peak_fwd_bwd=peak_fb, after_backward=after_bwd,
                                                              peak_step=peak_step, after_step=after).items()}
print(json.dumps(rows), flush=True)
