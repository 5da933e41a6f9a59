"""DPO on the worker against TRL's DPOTrainer (bench/trl_dpo.py) in the same call: the Qwen2.5-1.5B
shape with random weights, 1024-token pairs (prompt + answer, chosen and rejected each filled to
max_length), issue 32's targets.

    python bench/dpo.py --out dpo.jsonl                      # GPU: every part
    python bench/dpo.py --parts lora --steps 10 --warm 3     # one part
    python bench/dpo.py --smoke                              # CPU, a tiny model: the pipeline end to end

Parts:
  lora   LoRA r16 (all linear): TRL with and without its Liger DPO loss (bf16 base), ours as it is, with
         Liger's kernels and with torch_compile; the target compares the fastest of each side, and their
         peak memory.
  full   full fine-tuning under DeepSpeed ZeRO-3 on one GPU: TRL (its reference a second model
         prepared by DeepSpeed) with and without Liger, ours (the frozen copy partitioned as the policy)
         as it is and with Liger's kernels.
  compiled  TRL LoRA with the Trainer's torch_compile (and eager) against ours compiled (of this call's runs).
  again  the fastest configuration of each side of lora and full once more, ours first (against drift).
  precompute  full ZeRO-3 with precompute_ref_log_probs on both sides (no reference forward per step);
         ours as it is and with Liger's kernels.
  ranks  ours, full DPO on ZeRO-3 and on FSDP2 (learning rate 1e-8: every record is one pair, which
         1e-5 fitted in one step; the line says if the loss still reached ~0): the losses of 2 ranks sharing the GPU (each its own
         NCCL host, as bench/layout_memory.py runs them) against 1 rank with the same global batch. Every
         record is the same pair here: each data-parallel rank reads its own shard in its own shuffled
         order, so distinct pairs would make different steps, not the same ones split.
  pipeline  ours, LoRA DPO and full DPO (precomputed reference) under PP=2 on 2 ranks sharing the GPU
         against 1 rank, two micro-batches a step, by step.
  padding_free  ours, LoRA DPO on pairs of many lengths: padded against padding_free (sdpa, flex_attention).

Tokens/s count the prompt and answer tokens of both rows of each pair (both sides fill max_length,
so the count is the same for both; TRL's line reports its own count per pair to show it)."""
from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Compared, driver_parser, parts_of  # noqa: E402
from throughput import build_model_dir, estimated_gib, torchrun_argv  # noqa: E402

TRL = Path(__file__).resolve().parent / "trl_dpo.py"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, chars: int) -> str:
    out, size = [], 0
    while size < chars:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def write_pairs(path: Path, n: int, seq: int, same: bool = False, spread: bool = False) -> None:
    """TRL's conversational pair format (prompt / chosen / rejected message lists), which the worker
    reads too: a ~seq/4-character prompt and answers long enough that every row is cut at max_length
    (the demo tokenizer gives about one token per character). `same`: every record the same pair.
    `spread`: prompts of seq/16 to seq/4 characters and answers of seq/16 to seq/2, drawn evenly."""
    rng = random.Random(0)
    prompt = (lambda: rng.randint(seq // 16, seq // 4)) if spread else (lambda: seq // 4)
    answer = (lambda: rng.randint(seq // 16, seq // 2)) if spread else (lambda: seq * 2)
    with open(path, "w") as f:
        for _ in range(n):
            if same:
                rng.seed(0)
            f.write(json.dumps({"prompt": [{"role": "user", "content": words(rng, prompt())}],
                                "chosen": [{"role": "assistant", "content": words(rng, answer())}],
                                "rejected": [{"role": "assistant", "content": words(rng, answer())}]}) + "\n")


def our_job(model: Path, pairs: Path, seq: int, bsz: int, steps: int, lora: bool, dtype: str, **fields) -> dict:
    """The DPO job as TRL's run: beta 0.1, sigmoid loss, lr 1e-5, every step logged, no checkpoints,
    no activation recomputation, LoRA r16 alpha 32 on all linear layers."""
    return {**dict(model=str(model), dataset=[str(pairs)], rlhf_type="dpo", beta=0.1, train_type="lora" if lora else "full",
                   max_length=seq, per_device_train_batch_size=bsz, max_steps=steps, logging_steps=1, save_strategy="no",
                   learning_rate=1e-5, torch_dtype=dtype, gradient_checkpointing=False, use_liger_kernel=False,
                   lora_rank=16, lora_alpha=32, lora_dropout=0.0), **fields}


class Bench(Compared):
    def __init__(self, work: Path, steps: int, warm: int, out, smoke: bool):
        super().__init__(work, steps, warm, out, smoke)
        self.dtype = "float32" if smoke else "bfloat16"
        self.shape = "smoke" if smoke else "qwen2.5-1.5b"
        self.seq = 64 if smoke else 1024
        self.model = build_model_dir(self.shape, work / "model", self.dtype)

    def pairs(self, n: int, same: bool = False, spread: bool = False) -> Path:
        path = self.work / f"pairs-{n}{'-same' if same else ''}{'-spread' if spread else ''}.jsonl"
        if not path.exists():
            write_pairs(path, n, self.seq, same, spread)
        return path

    def trl(self, bsz: int, lora: bool, liger: bool = False, zero3: bool = False, precompute: bool = False,
            compile: bool = False) -> dict:
        argv = torchrun_argv(1, str(TRL), str(self.model), str(self.pairs(bsz * (self.steps + 1))), "--seq", str(self.seq),
                             "--bsz", str(bsz), "--steps", str(self.steps), "--warm", str(self.warm),
                             *["--lora"] * lora, *["--liger"] * liger, *["--zero3"] * zero3,
                             *["--precompute"] * precompute, *["--compile"] * compile)
        return self.baseline(argv, dict(source="trl", lora=lora, liger=liger, zero3=zero3, precompute=precompute,
                                        compile=compile))

    def ours(self, name: str, bsz: int, lora: bool, nproc: int = 1, same: bool = False, pairs_n: int | None = None,
             model: Path | None = None, spread: bool = False, **fields) -> dict:
        """`pairs_n`: the size of the pairs file (by default enough for every rank's steps); `model`:
        another model directory than the shape's; `spread`: pairs of many lengths (`write_pairs`)."""
        pairs = self.pairs(pairs_n or bsz * nproc * (self.steps + 1), same, spread)
        spec = our_job(model or self.model, pairs, self.seq, bsz, self.steps, lora, self.dtype, **fields)
        timing, train = self.worker(name, spec, nproc)
        row = dict(source="swift-studio", name=name, lora=lora, nproc=nproc, seq=self.seq, bsz=bsz, **fields)
        if "error" in timing:
            return self.emit({**row, **timing})
        tokens = timing.pop("tokens_per_step")
        return self.emit({**row, **timing, "tokens_per_pair": tokens / (bsz * nproc),
                          "estimated_gib": None if self.smoke else estimated_gib(self.work / name, self.shape, nproc),
                          "losses": [e["loss"] for e in train], "margins": [e["rewards_margins"] for e in train],
                          "logps_chosen": [e["logps_chosen"] for e in train],
                          "rewards_accuracies": train[-1].get("rewards_accuracies")})

    def versus(self, name: str, ours: list[dict], theirs: list[dict], goal: float) -> None:
        """The fastest run of each side, their ratio, and the peak memory of both."""
        ok = [r for r in ours if "error" not in r], [r for r in theirs if "error" not in r]
        if not all(ok):
            self.emit({"target": name, "ratio": None, "goal": goal, "met": None, "why": "a side has no run"})
            return
        best_ours, best_trl = (max(rows, key=lambda r: r["tokens_per_s"]) for rows in ok)
        ratio = round(best_ours["tokens_per_s"] / best_trl["tokens_per_s"], 3)
        self.emit({"target": name, "ratio": ratio, "goal": goal, "met": ratio >= goal and (
                   self.smoke or best_ours["peak_mem_gib"] <= best_trl["peak_mem_gib"]),
                   "ours": best_ours.get("name"), "trl": {k: best_trl.get(k) for k in ("liger", "zero3", "gc", "precompute", "compile")},
                   "peak_gib": best_ours.get("peak_mem_gib"), "trl_peak_gib": best_trl.get("peak_mem_gib"),
                   "estimated_gib": best_ours.get("estimated_gib")})

    def lora(self, bsz: int) -> None:
        theirs = [self.trl(bsz, lora=True, liger=liger) for liger in ([False] if self.smoke else [True, False])]
        ours = [self.ours("lora", bsz, True)] + ([] if self.smoke else [
            self.ours("lora-liger", bsz, True, use_liger_kernel=True),
            self.ours("lora-compile", bsz, True, torch_compile=True)])
        self.versus(f"DPO LoRA r16 {self.shape} {self.seq}-token pairs x{bsz}: ours vs TRL DPOTrainer (best)", ours,
                    theirs, 1.25)

    def full(self, bsz: int) -> None:
        theirs = [] if self.smoke else [self.trl(bsz, lora=False, liger=liger, zero3=True) for liger in (True, False)]
        ours = [self.ours("full-zero3", bsz, False, deepspeed="zero3")] + ([] if self.smoke else [
            self.ours("full-zero3-liger", bsz, False, deepspeed="zero3", use_liger_kernel=True)])
        self.versus(f"DPO full ZeRO-3 {self.shape} {self.seq}-token pairs x{bsz}: ours vs TRL DPOTrainer+DeepSpeed "
                    "ZeRO-3 (best)", ours, theirs, 1.10)

    def compiled(self, bsz: int) -> None:
        """TRL with the Trainer's torch_compile (not among its documented DPO speed settings; run so the
        compiled LoRA comparison is also made compiled against compiled), and eager if the lora part has
        not run it: TRL's best of the two is the baseline."""
        ours = [r for r in self.done if r.get("name") in ("lora-compile", "lora-compile-2") and "error" not in r]
        eager = [r for r in self.done if r.get("source") == "trl" and r.get("lora") and not r.get("liger")
                 and not r.get("compile") and "error" not in r]
        theirs = [self.trl(bsz, lora=True, compile=True)] + (eager or [self.trl(bsz, lora=True)])
        self.versus(f"DPO LoRA, both with torch_compile: {self.shape} {self.seq}-token pairs x{bsz}",
                    ours or [self.ours("lora-compile", bsz, True, torch_compile=True)], theirs, 1.25)

    def again(self, bsz: int) -> None:
        ours = [self.ours("lora-compile-2", bsz, True, torch_compile=True)]
        self.versus(f"DPO LoRA, again (ours first): {self.shape} {self.seq}-token pairs x{bsz}", ours,
                    [self.trl(bsz, lora=True)], 1.25)
        ours = [self.ours("full-zero3-2", bsz, False, deepspeed="zero3")]
        self.versus(f"DPO full ZeRO-3, again (ours first): {self.shape} {self.seq}-token pairs x{bsz}", ours,
                    [self.trl(bsz, lora=False, zero3=True)], 1.10)

    def precompute(self, bsz: int) -> None:
        ours = [self.ours("full-zero3-precompute", bsz, False, deepspeed="zero3", precompute_ref_log_probs=True)] + (
            [] if self.smoke else [self.ours("full-zero3-precompute-liger", bsz, False, deepspeed="zero3",
                                             precompute_ref_log_probs=True, use_liger_kernel=True)])
        self.versus(f"DPO full ZeRO-3 with precompute_ref_log_probs on both: {self.shape} {self.seq}-token pairs "
                    f"x{bsz}", ours, [self.trl(bsz, lora=False, zero3=True, precompute=True)], 1.10)

    def ranks(self, bsz: int) -> None:
        for engine in ({"deepspeed": "zero3"}, {"fsdp": "full_shard"}):
            label = next(iter(engine.values()))
            one = self.ours(f"ranks-{label}-1", bsz, False, same=True, learning_rate=1e-8, **engine)
            two = self.ours(f"ranks-{label}-2", bsz // 2, False, nproc=2, same=True, learning_rate=1e-8, **engine)
            if "error" in one or "error" in two:
                self.emit({"target": f"{label}: 2 ranks' losses vs 1 rank's", "met": False})
                continue
            self.alike(f"full DPO {label}: 2 ranks x {bsz // 2} pairs vs 1 rank x {bsz}, by step", one, two)

    def pipeline(self, bsz: int) -> None:
        """DPO under pipeline parallel on NCCL: PP=2 (two ranks sharing the GPU, one stage each) against
        one rank, the same pairs in the same order (a pipeline reads the data as one rank does), two
        micro-batches a step. LoRA takes its reference from the pipeline with the adapters off every
        step; full fine-tuning from the pass of precompute_ref_log_probs. The shape's model with its
        output layer untied from the embedding."""
        pairs_n = (self.steps + 1) * bsz
        # A pipeline refuses an output layer tied to the embedding (they live on different stages).
        untied = build_model_dir(self.shape, self.work / "model-untied", self.dtype, tie_word_embeddings=False)
        for lora, fields in ((True, {}), (False, {"precompute_ref_log_probs": True})):
            kind = "lora" if lora else "full-precompute"
            common = dict(gradient_accumulation_steps=2, pairs_n=pairs_n, model=untied, **fields)
            one = self.ours(f"pp-{kind}-1", bsz // 2, lora, **common)
            two = self.ours(f"pp-{kind}-2", bsz // 2, lora, nproc=2, pipeline_model_parallel_size=2, **common)
            if "error" in one or "error" in two:
                self.emit({"target": f"DPO {kind} PP=2 vs 1 rank", "met": False})
                continue
            self.alike(f"DPO {kind}: PP=2 (2 ranks) vs 1 rank, 2 micro-batches x {bsz // 2} pairs, by step", one, two)

    def padding_free(self, bsz: int) -> None:
        """Pairs of many lengths (`write_pairs(spread=True)`), LoRA DPO: padded micro-batches against
        padding_free ones, with sdpa (a dense mask over the flattened row) and flex_attention (the
        blocks between samples skipped); the tokens/s count real tokens only, so padding costs."""
        runs = [self.ours("spread-padded", bsz, True, spread=True),
                self.ours("spread-padding-free-sdpa", bsz, True, spread=True, padding_free=True),
                self.ours("spread-padding-free-flex", bsz, True, spread=True, padding_free=True,
                          attn_impl="flex_attention")]
        base = runs[0]
        for row in runs[1:]:
            ratio = (round(row["tokens_per_s"] / base["tokens_per_s"], 3)
                     if "error" not in row and "error" not in base else None)
            same = ("error" not in row and "error" not in base and
                    max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base["losses"], row["losses"])))
            self.emit({"target": f"{row['name']} vs padded, LoRA DPO on spread pairs x{bsz}", "ratio": ratio,
                       "max_rel_loss_diff": same if same is False else float(f"{same:.3g}")})

    def alike(self, target: str, one: dict, two: dict) -> None:
        worst = {key: max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(one[key], two[key]))
                 for key in ("losses", "margins", "logps_chosen")}
        # A pair fitted in a step (loss near 0) would make later steps agree whatever the gradients were.
        saturated = min(one["losses"]) < 1e-3
        self.emit({"target": target, "max_rel_diff": {k: float(f"{v:.3g}") for k, v in worst.items()},
                   "saturated": saturated, "one": one["losses"], "two": two["losses"]})


PARTS = ("lora", "full", "again", "compiled", "precompute", "ranks", "pipeline", "padding_free")


def main() -> int:
    parser = driver_parser(__doc__, PARTS, "lora,full,ranks")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    parts = parts_of(parser, args, PARTS)
    if args.workdir and args.workdir.exists() and any(args.workdir.iterdir()):
        # Its runs, pairs and model are written by name: nothing there may be overwritten or read as ours.
        parser.error(f"--workdir: {args.workdir} is not empty; give a new or empty directory")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    steps, warm = (4, 1) if args.smoke else (args.steps, args.warm)
    try:
        with open(args.out, "w") as out:
            bench = Bench(work, steps, warm, out, args.smoke)
            for part in parts:
                getattr(bench, part)(args.ranks_bsz if part in ("ranks", "pipeline") else (2 if args.smoke else args.bsz))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
