"""The stock stack's best for long-context LoRA on one GPU, as a user would set it up: HF Trainer,
peft LoRA r16 on every linear layer, Liger kernels (its fused linear cross-entropy never builds the
logits), gradient checkpointing, SDPA, a bf16 base model, micro-batch 1. Random weights from the
config and random tokens, as ../shared/bench/hf_baseline.py (whose `run` signature it keeps, so
bench/throughput.py runs it the same way). Prints one JSON line per configuration.

    python bench/hf_long_context.py llama3.1-8b 16384 [32768 ...]
"""
import json
import sys
import time

import torch
from torch.utils.data import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

SHAPES = {
    # Llama-3.1-8B-like; positions up to 512K so no length is refused by the config.
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                        rope_theta=500000.0, max_position_embeddings=524288),
}


class RandomTokens(Dataset):
    def __init__(self, n, seq, vocab):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Timer(TrainerCallback):
    def __init__(self, warm):
        self.warm, self.t0, self.t1, self.n = warm, None, None, 0

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        if state.global_step == self.warm:
            self.t0 = time.perf_counter()
        elif state.global_step > self.warm:
            self.n += 1
        self.t1 = time.perf_counter()


def run(name, seq, bsz=1, lora=True, liger=True, gc=True, steps=3, warm=1):
    config = AutoConfig.for_model(**SHAPES[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir="/tmp/hf-long", per_device_train_batch_size=bsz, max_steps=steps, bf16=True,
                             learning_rate=1e-5, logging_steps=1000, save_strategy="no", report_to=[],
                             gradient_checkpointing=gc, use_liger_kernel=liger, optim="adamw_torch_fused",
                             disable_tqdm=True, dataloader_num_workers=1)
    timer = Timer(warm)
    torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=args, train_dataset=RandomTokens(bsz * (steps + 1), seq, config.vocab_size),
            callbacks=[timer]).train()
    step_s = (timer.t1 - timer.t0) / timer.n
    return dict(model=name, seq=seq, bsz=bsz, lora=lora, liger=liger, gc=gc, bf16_base=True, step_s=round(step_s, 3),
                tokens_per_s=round(bsz * seq / step_s), peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))


if __name__ == "__main__":
    for seq in sys.argv[2:]:
        print(json.dumps(run(sys.argv[1], int(seq))), flush=True)
