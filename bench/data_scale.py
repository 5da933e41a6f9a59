"""The data path at scale: tokenizing a generated chat dataset into the Arrow cache, and what a rank
does on a start that finds the cache (a resume, a second run).

For each dataset size and shape it generates a JSONL of chat samples (`short`: the demo's, one
question and a one-line answer; `long`: one to four turns with answers of a paragraph; a system
prompt in a third of them; deleted after), then:

* `tokenize`: `open_tokenized` with `dataset_num_proc` processes: samples/s (wall, cache write included);
* `resume`: in a fresh process, what a rank of an 8-rank data-parallel job does before its first
  step on a cache hit: open the entry, take its shard, pack it (`--packing`) and build the first
  micro-batch. Its seconds and its resident memory above the same process right after importing
  (torch, transformers, datasets and the tokenizer loaded): the per-rank cost of the data.

One JSON line per (size, tokenizer, num_proc); asserts nothing.

    python bench/data_scale.py [--samples 100000 1000000] [--shape short long] [--num-proc 1 2] [--tokenizer demo bpe]

`demo` is the bundled demo model's tokenizer (byte-level BPE, 384 tokens); `bpe` is a byte-level BPE
of 32,000 tokens trained here on the generated text (as a real model's, with ChatML), so nothing
is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("model data train layer token batch rank node cluster memory gradient loss step epoch shard "
         "checkpoint learning rate warmup schedule optimizer weight decay attention head expert").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


SHAPES = {  # turns, user words, assistant words
    "short": ((1, 1), (4, 10), (3, 12)),  # the demo's shape: one question, a one-line answer (~210 bytes)
    "long": ((1, 4), (5, 40), (10, 120)),  # multi-turn, answers of a paragraph (~1.7 KB)
}


def write_chats(path: Path, n: int, shape: str, seed: int = 0) -> None:
    (t0, t1), (u0, u1), (a0, a1) = SHAPES[shape]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": sentence(rng, 8)}] if rng.random() < 1 / 3 else []
            for _ in range(rng.randint(t0, t1)):
                messages += [{"role": "user", "content": sentence(rng, rng.randint(u0, u1))},
                             {"role": "assistant", "content": sentence(rng, rng.randint(a0, a1))}]
            f.write(json.dumps({"messages": messages}) + "\n")


def bpe_tokenizer(corpus: Path, out: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    lines = (json.loads(line)["messages"][-1]["content"] for line in open(corpus))
    bpe.train_from_iterator((next(lines) for _ in range(20000)), vocab_size=32000,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    return out


RESUME = r"""
import json, os, sys, time, psutil
from pathlib import Path
from transformers import AutoTokenizer
import numpy as np, pyarrow  # imported by the worker in any case: not the data's cost
from backend.job.spec import JobSpec
from launcher import data
from launcher.tokenized import open_tokenized
spec = JobSpec(**json.loads(sys.argv[1]))
tok = AutoTokenizer.from_pretrained(sys.argv[2])
proc = psutil.Process()
def anon(m):  # resident memory that is not file-backed: mapped Arrow pages the kernel can drop are left out
    return m.rss - m.shared
base, base_anon = proc.memory_info().rss, anon(proc.memory_info())
t0 = time.perf_counter()
tk = open_tokenized(spec, tok, Path(sys.argv[3]))
rows, dropped = tk.shard(0, 8)
plan = data.pack_plan(tk.lengths(rows), spec.max_length) if spec.packing else data.one_per_row(len(rows))
batches = data.Batches(lambda m: tk.samples(rows[m]), plan, 4, 1, len(plan) // 4, 0, 0, spec.packing, spec.max_length)
batches.step(0)
seconds = time.perf_counter() - t0
print(json.dumps({"resume_s": round(seconds, 2), "built": tk.built, "rank_samples": len(rows), "rank_rows": len(plan),
                  "rss_above_imports_mib": round((proc.memory_info().rss - base) / 2**20, 1),
                  "anon_above_imports_mib": round((anon(proc.memory_info()) - base_anon) / 2**20, 1)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000])
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokenizer", nargs="+", default=["demo"], choices=["demo", "bpe"])
    ap.add_argument("--shape", nargs="+", default=["short", "long"], choices=list(SHAPES))
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--packing", action="store_true")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from backend.job.spec import JobSpec
    from launcher.tokenized import open_tokenized

    work = Path(tempfile.mkdtemp(prefix="data-scale-"))
    try:
        for n, shape in ((n, shape) for n in args.samples for shape in args.shape):
            data = work / f"chats-{shape}-{n}.jsonl"
            write_chats(data, n, shape)
            for name in args.tokenizer:
                model = (ROOT / "assets" / "demo" / "model" if name == "demo"
                         else bpe_tokenizer(data, work / f"bpe-{shape}-{n}"))
                tok = AutoTokenizer.from_pretrained(model)
                for num_proc in args.num_proc:
                    cache = work / f"cache-{shape}-{name}-{n}-{num_proc}"
                    fields = dict(model="m", dataset=[str(data)], max_length=args.max_length,
                                  dataset_num_proc=num_proc, packing=args.packing)
                    t0 = time.perf_counter()
                    tk = open_tokenized(JobSpec(**fields), tok, cache)
                    seconds = time.perf_counter() - t0
                    row = {"samples": n, "shape": shape, "file_mib": round(data.stat().st_size / 2**20, 1), "tokenizer": name,
                           "num_proc": num_proc, "tokenize_s": round(seconds, 2),
                           "samples_per_s": round(n / seconds),
                           "tokens_per_s": round(sum(tk.table.column("length").to_numpy()) / seconds),
                           "load_avg": os.getloadavg()[0]}
                    del tk
                    resume = subprocess.run([sys.executable, "-c", RESUME, json.dumps(fields), str(model), str(cache)],
                                            cwd=ROOT, capture_output=True, text=True)
                    if resume.returncode:
                        sys.exit(f"the resume process failed:\n{resume.stderr[-3000:]}")
                    row |= json.loads(resume.stdout.strip().splitlines()[-1])
                    print(json.dumps(row), flush=True)
                    shutil.rmtree(cache)
            data.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
