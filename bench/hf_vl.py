"""The stock baseline of bench/vl.py: HF Trainer + peft LoRA on a Qwen2.5-VL model directory and an
image data file in ms-swift's format (`messages` with `<image>` tags, `images` beside the file), one
configuration per process, under torchrun. The collator renders each conversation with the chat
template, runs the directory's image processor, expands each image's placeholder to its visual tokens
as transformers' Qwen2.5-VL processor does (that class cannot be built without torchvision, which its
video processor needs), and masks the labels up to the answer. Prints
one JSON line from rank 0: step time, tokens/s (every non-padding token, the visual ones included),
peak allocated memory, the losses by step.

    torchrun --nproc_per_node 1 bench/hf_vl.py MODEL_DIR images.jsonl --seq 1024 --bsz 8 --liger
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_dpo import Timer, baseline_parser, profiled  # noqa: E402

# freeze_vit / freeze_aligner: the adapters on the language model's linear layers alone
PAD = "<|image_pad|>"
LANGUAGE_LINEAR = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def parts(content: str) -> list[dict]:
    """A string with `<image>` tags as the content parts chat templates take."""
    out = []
    for i, text in enumerate(content.split("<image>")):
        if i:
            out.append({"type": "image"})
        if text:
            out.append({"type": "text", "text": text})
    return out


class Collator:
    def __init__(self, tokenizer, images, root: Path):
        self.tokenizer, self.images, self.root = tokenizer, images, root
        self.answer = tokenizer.encode("<|im_start|>assistant\n")

    def __call__(self, records: list[dict]) -> dict:
        texts, images = [], []
        for record in records:
            messages = [{**m, "content": parts(m["content"])} for m in record["messages"]]
            texts.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
            images += [Image.open(self.root / path).convert("RGB") for path in record["images"]]
        pixels = self.images(images=images, return_tensors="pt")
        visual = iter((pixels["image_grid_thw"].prod(-1) // self.images.merge_size ** 2).tolist())
        texts = ["".join(piece if i == 0 else PAD * next(visual) + piece for i, piece in enumerate(text.split(PAD)))
                 for text in texts]
        batch = {**self.tokenizer(texts, padding=True, return_tensors="pt"), **pixels}
        # which tokens are an image's (1), as the processor returns them: Qwen3-VL's rope reads them
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.tokenizer.convert_tokens_to_ids(PAD)).int()
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        n = len(self.answer)
        for row in labels:  # the prompt masked: up to the last assistant header
            ids = row.tolist()
            start = max(i + n for i in range(len(ids) - n + 1) if ids[i:i + n] == self.answer)
            row[:start] = -100
        return {**batch, "labels": labels}


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Trainer, TrainingArguments

    parser = baseline_parser(__doc__, "data")
    parser.add_argument("--max-pixels", type=int, required=True)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.bfloat16 if gpu else torch.float32,
                                                        attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LANGUAGE_LINEAR,
                                             task_type="CAUSAL_LM"))
    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    collate = Collator(AutoTokenizer.from_pretrained(args.model),
                       AutoImageProcessor.from_pretrained(args.model, max_pixels=args.max_pixels), Path(args.data).parent)
    tokens = [int(collate([r])["attention_mask"].sum()) for r in records]
    too_long = [i for i, n in enumerate(tokens) if n > args.seq]
    if too_long:  # truncating would cut an image's tokens: the data is made to fit instead
        raise SystemExit(f"{len(too_long)} records over --seq {args.seq} tokens (the first: line {too_long[0] + 1}, "
                         f"{tokens[too_long[0]]})")
    config = TrainingArguments(output_dir=os.environ.get("TMPDIR", "/tmp") + "/hf-vl", per_device_train_batch_size=args.bsz,
                               max_steps=args.steps, learning_rate=1e-4, bf16=gpu, logging_steps=1, save_strategy="no",
                               report_to=[], gradient_checkpointing=args.gc, use_liger_kernel=args.liger,
                               optim="adamw_torch_fused" if gpu else "adamw_torch", dataloader_num_workers=2,
                               remove_unused_columns=False, disable_tqdm=True)
    timer = Timer(args.warm)
    trainer = Trainer(model=model, args=config, train_dataset=records, data_collator=collate, callbacks=[timer])
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        profiled(trainer, args.warm, args.steps - args.warm, args.profile)
    else:
        trainer.train()
    step_s = (timer.ended - timer.started) / timer.timed
    tokens_per_step = sum(tokens) / len(tokens) * args.bsz * int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(dict(source="hf+peft", liger=args.liger, gc=args.gc, seq=args.seq, bsz=args.bsz,
                              tokens_per_sample=sum(tokens) / len(tokens), step_s=round(step_s, 4),
                              tokens_per_s=round(tokens_per_step / step_s),
                              peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
                              losses=[round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h])),
              flush=True)


if __name__ == "__main__":
    main()
