"""The stock baseline of bench/dpo.py: TRL's DPOTrainer on a model directory and a pairs file, one
configuration per process, under torchrun (DeepSpeed's ZeRO-3 needs its process group). Prints one
JSON line from rank 0: step time, tokens/s (prompt + answer tokens of chosen and rejected rows,
padding not counted), peak allocated memory, the losses by step.

    torchrun --nproc_per_node 1 bench/trl_dpo.py MODEL_DIR PAIRS.jsonl --seq 1024 --bsz 8 --lora --liger
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import TrainerCallback


class Timer(TrainerCallback):
    """Wall time of the steps after `warm` (each step's end synchronised with the device)."""

    def __init__(self, warm: int):
        self.warm, self.started, self.ended, self.timed = warm, None, None, 0

    def on_step_end(self, args, state, control, **_):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if state.global_step == self.warm:
            self.started = now
        elif state.global_step > self.warm:
            self.timed += 1
            self.ended = now


def baseline_parser(doc: str, data: str) -> argparse.ArgumentParser:
    """The arguments every stock baseline takes (this one and bench/hf_vl.py): the model directory,
    the data file (named `data`), sizes, steps, the stock speed switches and the profiler."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument(data)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--bsz", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="print torch.profiler's kernel table (ROWS rows) of the steps after --warm, as "
                             "bench/profile_step.py does for ours")
    return parser


ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "bf16": {"enabled": "auto"},
         "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                               "stage3_gather_16bit_weights_on_model_save": False}}


def main() -> None:
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    parser = baseline_parser(__doc__, "pairs")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--zero3", action="store_true")
    parser.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--compile", action="store_true", help="the Trainer's torch_compile")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if gpu else torch.float32
    config = DPOConfig(output_dir=os.environ.get("TMPDIR", "/tmp") + "/trl-dpo", per_device_train_batch_size=args.bsz,
                       max_steps=args.steps, learning_rate=args.lr, beta=0.1,
                       precompute_ref_log_probs=args.precompute, torch_compile=args.compile, max_length=args.seq, bf16=gpu,
                       logging_steps=1, save_strategy="no", report_to=[], gradient_checkpointing=args.gc,
                       use_liger_kernel=args.liger, optim="adamw_torch_fused" if gpu else "adamw_torch",
                       dataloader_num_workers=2, disable_tqdm=True, deepspeed=ZERO3 if args.zero3 else None,
                       model_init_kwargs={"dtype": dtype})
    peft = None
    if args.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    timer = Timer(args.warm)
    # A path: TRL loads the policy, and for full fine-tuning the reference from the same path.
    trainer = DPOTrainer(model=args.model, args=config, train_dataset=load_dataset("json", data_files=args.pairs)["train"],
                         peft_config=peft, callbacks=[timer])
    rows = trainer.train_dataset
    per_pair = [min(len(p) + len(c), args.seq) + min(len(p) + len(r), args.seq)
                for p, c, r in zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])]
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        profiled(trainer, args.warm, args.steps - args.warm, args.profile)
    else:
        trainer.train()
    step_s = (timer.ended - timer.started) / timer.timed
    tokens_per_step = sum(per_pair) / len(per_pair) * args.bsz * int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(dict(source="trl", lora=args.lora, liger=args.liger, zero3=args.zero3, gc=args.gc,
                              precompute=args.precompute, compile=args.compile, seq=args.seq,
                              bsz=args.bsz, tokens_per_pair=sum(per_pair) / len(per_pair), step_s=round(step_s, 4),
                              tokens_per_s=round(tokens_per_step / step_s),
                              peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
                              losses=[round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h])),
              flush=True)


def profiled(trainer, warm: int, active: int, rows: int) -> None:
    """`trainer.train()` under torch.profiler, its steps after `warm` recorded; rank 0 prints the table
    (profiled steps are slower: compare kernel times, not the step time)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    class Step(TrainerCallback):
        def on_step_end(self, *_, **__):
            prof.step()

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=warm, active=active, repeat=1)) as prof:
        trainer.add_callback(Step())
        trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        averages = prof.key_averages()
        print(averages.table(sort_by=sort, row_limit=rows, max_name_column_width=90), flush=True)
        if torch.cuda.is_available():  # set against the step's wall time: how much of it the GPU was busy
            # the kernels' own time, as the table's "Self CUDA time total" sums it: the operators
            # that launch them and the ProfilerStep annotations count the same time again
            busy = sum(e.self_device_time_total for e in averages
                       if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / active / 1e6
            print(f"GPU kernel time a profiled step: {busy:.4f} s", flush=True)


if __name__ == "__main__":
    main()
