"""Throughput of the swift-studio worker for the model shapes of the shared HF baseline
(../shared/bench/hf_baseline.py): models built from config with random weights, random tokens.

    python bench/throughput.py [--shapes qwen2.5-1.5b,llama3.2-1b] [--nproc 1] [--baseline PATH]
    python bench/throughput.py --smoke          # tiny model on CPU, checks the pipeline end to end
    python bench/throughput.py --suite results.jsonl [--part single|multi|all] [--repeat 2] --baseline ../shared/bench/hf_baseline.py
                                                # GPU: every target of docs/benchmarks.md, with its ratio
    python bench/throughput.py --suite long.jsonl --part long --seqs 16384,32768 --steps 3 --warm 1
                                                # GPU: 8B long-context LoRA, ours (as it is / tiled + offload) vs HF
    python bench/throughput.py --variants plan.jsonl --out results.jsonl --baseline ../shared/bench/hf_baseline.py
                                                # GPU: the configurations listed in plan.jsonl (Suite.variants)

Each configuration runs the real worker (`torchrun -m launcher.train`) on a fresh run directory
and prints one JSON line: step time, tokens/s, MFU (full fine-tuning only, as the baseline) and
peak memory, read back from the worker's own event lines. With `--baseline`, the stock HF
Trainer baseline runs the same configurations in the same call (one process each) and its lines
are printed next to ours.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # backend.job.memory, for the estimates beside the measured peaks
DEFAULT_BASELINE = ROOT.parent / "shared" / "bench" / "hf_baseline.py"
LONG_BASELINE = ROOT / "bench" / "hf_long_context.py"
# The shapes of hf_baseline.py (kept identical so the figures compare).
SHAPES = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=8192),
    # bench/hf_long_context.py's (the long-context baseline), identical.
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                        rope_theta=500000.0, max_position_embeddings=524288),
    # A Qwen3-MoE of 8 layers (Qwen3-30B-A3B's attention and experts' widths, 64 experts, 8 per
    # token): the MoE memory estimate and the routing telemetry on one GPU (no stock baseline).
    "qwen3-moe-3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=64, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                         vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=32768),
    # bench/advisor.py's jobs: shapes the advisor's cost model was not tuned on (the real models' configs).
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                        rope_theta=500000.0, max_position_embeddings=131072),
    "smoke": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256),
}
# (shape, seq, micro-batch, lora, liger) as in the baseline's plan.
PLAN = [("qwen2.5-1.5b", 2048, 8, False, False), ("qwen2.5-1.5b", 2048, 8, False, True),
        ("qwen2.5-1.5b", 2048, 8, True, False), ("qwen2.5-1.5b", 2048, 8, True, True),
        ("llama3.2-1b", 4096, 4, False, False), ("llama3.2-1b", 4096, 4, False, True)]
SMOKE_PLAN = [("smoke", 64, 2, False, False), ("smoke", 64, 2, True, False)]


def build_model_dir(shape: str, out: Path, dtype: str, **overrides) -> Path:
    """Random weights from the config (`overrides` change its fields) plus a tokenizer (the demo's;
    the data is pre-tokenized)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(**{**SHAPES[shape], **overrides})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    # The measured runs are other processes on this GPU: weights left in this process's cache (7.4 GiB
    # for the 3B shape) made runs that fit run out of memory.
    del model
    torch.cuda.empty_cache()
    AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model").save_pretrained(out)
    return out


def write_tokens(path: Path, n: int, seq: int, vocab: int, min_len: int | None = None) -> None:
    """n random-token samples of length seq, or uniformly min_len..seq long (mixed lengths)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.randint(min_len, seq) if min_len else seq
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(length)]}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_spec(model_dir: Path, data: Path, seq: int, bsz: int, steps: int, lora: bool = False, liger: bool = True,
             dtype: str = "bfloat16", **fields) -> dict:
    """The benchmark job: every step logged (its event times the step), no checkpoints, no
    activation recomputation (the HF baseline runs without), LoRA as the baseline's; `fields`
    override any of it."""
    spec = dict(model=str(model_dir), dataset=[str(data)], train_type="lora" if lora else "full", max_length=seq,
                per_device_train_batch_size=bsz, max_steps=steps, logging_steps=1, save_strategy="no",
                learning_rate=1e-5, torch_dtype=dtype, gradient_checkpointing=False, use_liger_kernel=liger,
                lora_rank=16, lora_alpha=32, lora_dropout=0.0)
    return {**spec, **fields}


def write_run(run_dir: Path, model_dir: Path, shape: str, seq: int, bsz: int, steps: int, samples: int,
              min_len: int | None = None, **fields) -> Path:
    """A run directory for the worker: `samples` random-token samples and the benchmark job."""
    run_dir.mkdir(parents=True)
    data = run_dir / "tokens.jsonl"
    write_tokens(data, samples, seq, SHAPES[shape]["vocab_size"], min_len)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job_spec(model_dir, data, seq, bsz, steps, **fields)))
    return run_dir


def torchrun_argv(nproc: int, *target: str) -> list[str]:
    """torchrun on this machine with a free rendezvous port, no restarts."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max_restarts", "0", *target]


def run_worker(work: Path, model_dir: Path, shape: str, seq: int, bsz: int, lora: bool, liger: bool, nproc: int,
               steps: int, warm: int, engine: dict, dtype: str, extra: dict | None = None,
               min_len: int | None = None, agent: bool = False, devices: str | None = None) -> dict:
    """One worker run. `extra` adds spec fields (torch_compile, packing); `min_len` makes the data
    mixed-length; `agent` runs the node agent at 1 Hz beside the workers; `devices` sets
    CUDA_VISIBLE_DEVICES."""
    extra = extra or {}
    # An engine value may be a DeepSpeed JSON path: its stem keeps the run directory one level deep.
    tag = "-".join([Path(str(v)).stem for v in engine.values()] + [k for k, v in extra.items() if v]) + \
        ("-mixed" if min_len else "") + ("-agent" if agent else "")
    run_dir = work / f"{shape}-{seq}x{bsz}-{'lora' if lora else 'full'}{'-liger' if liger else ''}{'-' + tag if tag else ''}"
    shutil.rmtree(run_dir, ignore_errors=True)
    samples = bsz * nproc * (steps + 1) * (seq // min_len if min_len else 1)
    write_run(run_dir, model_dir, shape, seq, bsz, steps, samples, min_len, lora=lora, liger=liger, dtype=dtype,
              **engine, **extra)
    argv = torchrun_argv(nproc, "-m", "launcher.train", "--run-dir", str(run_dir))
    env = {**gpu_env(devices),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # torchrun leads its own process group, recorded where the agent looks for the run's
    # processes (as the launcher does), so the agent does its full work: rank discovery, per-pid GPU memory.
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watcher = None
    try:
        (run_dir / "pids").mkdir()
        (run_dir / "pids" / "localhost.pid").write_text(str(proc.pid))
        watcher = (subprocess.Popen([sys.executable, "-m", "backend.telemetry.agent", "--run-id", "bench", "--run-dir",
                                     str(run_dir), "--node", "localhost", "--interval", "1"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if agent else None)
        started = time.monotonic()
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: Ctrl-C misses its session, and the caller drops the work dir
            stop_group(proc)
        if watcher:
            watcher.terminate()
            watcher.wait()
    result = dict(source="swift-studio", model=shape, seq=seq, bsz=bsz, lora=lora, liger=liger, nproc=nproc,
                  mixed_lengths=bool(min_len), agent=agent, **engine, **extra,
                  wall_s=round(time.monotonic() - started))
    events = [json.loads(line) for line in (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()] \
        if (run_dir / "events" / "rank-0.jsonl").exists() else []
    train = [e for e in events if e["type"] == "train" and e["step"] > warm]
    if proc.returncode != 0 or not train:
        return {**result, "error": run_error(run_dir, stdout + stderr)}
    # Wall clock between the first and last timed train events (each logging step ends with a
    # device→host copy, so these times are synchronised); the events' own step_time_s is not.
    step_s = (train[-1]["time"] - train[0]["time"]) / (train[-1]["step"] - train[0]["step"]) if len(train) > 1 \
        else train[0]["step_time_s"]  # one timed step (the longest sequences): its own time
    mfus = [e["mfu"] for e in train if e["mfu"] is not None]
    timed = train[1:] or train  # the first event's rate spans the warm-up; one timed step has only it
    useful = sum(e["tokens_per_s"] for e in timed) / len(timed)  # non-padding tokens
    return {**result, "step_s": round(step_s, 4), "tokens_per_s": round(bsz * seq * nproc / step_s),
            "estimated_gib": estimated_gib(run_dir, shape, nproc),
            "useful_tokens_per_s": round(useful),
            "mfu": round(sum(mfus) / len(mfus), 4) if mfus else None,
            "peak_mem_gib": round(max(e["mem_peak_gib"] for e in train), 2),
            **({"moe_aux_loss": round(train[-1]["moe_aux_loss"], 4),
                "moe_max_expert_share": round(train[-1]["moe_max_expert_share"], 4)} if "moe_aux_loss" in train[-1] else {})}


def estimated_gib(run_dir: Path, shape: str, nproc: int, config: dict | None = None) -> float:
    """backend.job.memory's estimate for the run's job, comparable with the measured peak (allocated
    memory: without the CUDA context); `config`: the model's config.json, where the shape is not
    one of SHAPES."""
    from backend.job.layout import compute_layout
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import parse_model_config
    from backend.job.spec import load_spec

    spec, _ = load_spec(run_dir / "job.yaml")
    spec = spec.model_copy(update={"nproc_per_node": nproc})
    est = estimate_memory(spec, parse_model_config(config or SHAPES[shape], shape), compute_layout(spec))
    return round(est.total_gib - est.other_gib, 2)


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """End a process that leads its own group and everything in it: SIGTERM (torchrun then stops its
    ranks, giving them 30 s), SIGKILL if it outlasts `grace_s`."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_error(run_dir: Path, output: str) -> str:
    """Why a worker run failed: the earliest `end` event of any rank that carries an error (a rank
    other than 0 may be the one that failed, the others then stopping for it: an out-of-memory on one
    of the ranks sharing a GPU), else the first error line of its output."""
    ended = []
    for events_file in (run_dir / "events").glob("rank-*.jsonl"):
        for line in events_file.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line cut short by a rank's death
                continue
            if event.get("type") == "end" and event.get("error"):
                ended.append((event.get("time") or 0.0, f"{events_file.stem}: {event['error']}"))
    return min(ended)[1][-2000:] if ended else _first_error(output)


# The line a rank's uncaught exception ends its traceback with ("[rank0]: torch.OutOfMemoryError: ...").
RAISED = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b(?<!ChildFailedError)")


def _first_error(output: str) -> str:
    """The worker's own error (torchrun's summary at the end says only that a rank failed): where it
    was first reported, and the exception a rank raised, which a deep traceback puts far below."""
    lines = output.splitlines()
    # A traceback where there is one (a tokenizer's warning may say "errors" long before it)
    hits = [i for i, line in enumerate(lines) if "Traceback" in line] or \
        [i for i, line in enumerate(lines) if "error" in line.lower() and "Warning" not in line]
    if not hits:
        return output[-2000:]
    raised = [i for i, line in enumerate(lines) if RAISED.match(line)]
    head = "\n".join(lines[hits[0]:hits[0] + 12])
    if raised and raised[-1] >= hits[0] + 12:
        return (head[:1000] + "\n...\n" + "\n".join(lines[raised[-1]:raised[-1] + 6]))[-2000:]
    return "\n".join(lines[hits[0]:hits[0] + 30])[-2000:]



def gpu_env(devices: str | None) -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": devices} if devices is not None else dict(os.environ)


def run_baseline_config(script: Path, config: tuple, devices: str | None = None) -> dict:
    """One configuration of the HF Trainer baseline, in its own process (its own GPU memory)."""
    code = (f"import json, sys; sys.path.insert(0, {str(script.parent)!r}); import {script.stem} as h; "
            f"print(json.dumps(h.run(*{config!r})))")
    return _baseline_result([sys.executable, "-c", code], gpu_env(devices), config=config)


def run_baseline_multi(script: Path, mode: str, nproc: int) -> dict:
    """The HF Trainer scaling baseline (hf_baseline_multi.py) under torchrun, MODE=ddp|zero2|zero3|fsdp."""
    return _baseline_result(torchrun_argv(nproc, str(script)), {**os.environ, "MODE": mode}, mode=mode, nproc=nproc)


def _baseline_result(argv: list[str], env: dict, **context) -> dict:
    """Run a baseline; its last JSON line, or its error with what was run."""
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = {"wall_s": round(time.monotonic() - started)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"source": "hf_trainer", **json.loads(lines[-1]), **wall} if lines else \
        {"source": "hf_trainer", **context, "error": _first_error(proc.stderr), **wall}


def ratio(ours: dict, theirs: dict, key: str = "tokens_per_s") -> float | None:
    if "error" in ours or "error" in theirs:
        return None
    return round(ours[key] / theirs[key], 3)


def mean_run(rows: list[dict]) -> dict:
    """Mean tokens/s and highest peak memory of repeated runs; the first error where one failed."""
    failed = [row for row in rows if "error" in row]
    if failed:
        return failed[0]
    peaks = [row["peak_mem_gib"] for row in rows if row.get("peak_mem_gib") is not None]
    return {"tokens_per_s": round(sum(row["tokens_per_s"] for row in rows) / len(rows)),
            "peak_mem_gib": max(peaks) if peaks else None}


# The fastest configuration of ours for full fine-tuning on one GPU: FSDP2 keeps fp32 master
# weights and computes in bf16 (no per-step autocast weight casts), without re-gathering the bf16
# weights for backward (shard_grad_op), torch_compile per decoder layer.
FAST_FULL = dict(engine={"fsdp": "shard_grad_op"}, extra={"torch_compile": True})


class Target(NamedTuple):
    """A single-GPU target of Suite.single: its ratio is the mean of ours / theirs over `pairs` of
    Suite.single's job names. An `alone` target's runs get the machine to themselves, one at a time,
    in run_order()."""

    group: str
    name: str
    goal: float
    pairs: tuple[tuple[str, str], ...]
    key: str = "tokens_per_s"
    memory: bool = False
    alone: bool = False

    def run_order(self) -> list[str]:
        """Its job names, the pairs alternating theirs-first and ours-first against drift."""
        return [name for i, pair in enumerate(self.pairs) for name in (pair[::-1] if i % 2 == 0 else pair)]


SINGLE_TARGETS = (
    Target("full", "full qwen2.5-1.5b 2048x8 (FSDP2 shard_grad_op + compile) vs HF+Liger", 1.10,
           (("qwen_full", "hf_qwen_full"),), memory=True),
    Target("full", "full llama3.2-1b 4096x4 (FSDP2 shard_grad_op + compile) vs HF+Liger", 1.10,
           (("llama_full", "hf_llama_full"),), memory=True),
    Target("lora", "LoRA r16 qwen2.5-1.5b 2048x8 (+ compile) vs HF LoRA", 1.35, (("qwen_lora", "hf_qwen_lora"),)),
    Target("packing", "packing (flex_attention), mixed lengths 50-2048: useful tokens/s packed vs padded", 2.0,
           (("packed", "padded"),), key="useful_tokens_per_s"),
    # Two pairs (run off_1, on_1, on_2, off_2) against drift; the agent samples every GPU of its node,
    # so its runs are alone.
    Target("agent", "telemetry agent at 1 Hz: tokens/s with / without (mean of two pairs)", 0.99,
           (("agent_on_1", "agent_off_1"), ("agent_on_2", "agent_off_2")), alone=True),
)
# Long context on one GPU: the activations of one long sequence, kept in bounds by activation
# checkpointing and Liger's fused loss on both sides (the stock stack's best for long sequences).
# Ulysses SP needs two GPUs or more: its figures belong to the multi-GPU benchmark.
LONG_SEQS = (8192, 16384, 32768)
SINGLE_TARGETS += tuple(
    Target("long", f"long context llama3.2-1b {seq}x1 full + GC (FSDP2 shard_grad_op + compile) vs HF+Liger+GC", 1.0,
           ((f"long_{seq}", f"hf_long_{seq}"),), memory=True)
    for seq in LONG_SEQS)
SINGLE_GROUPS = tuple(dict.fromkeys(t.group for t in SINGLE_TARGETS))
# Long context on one GPU for the 8B shape (Suite.long_context): ours as it is, and with the
# sequence-tiled MLP and activation offload (launcher/longseq.py).
# The ones without tiling and offload are held to the 1.10x goal; tiling and offload report their cost.
LONG_VARIANTS = {"as it is": {}, "torch_compile": {"torch_compile": True},
                 "tiled MLP + offload": {"tiled_mlp": True, "activation_cpu_offload": True}}
LONG_SAVERS = ("tiled_mlp", "activation_cpu_offload")
LONG_CONTEXT_SEQS = (16384, 32768, 65536, 131072)
# hf_baseline_multi.py's MODE -> our engine fields for the same engine.
MULTI_ENGINES = {"ddp": {}, "zero2": {"deepspeed": "zero2"}, "zero3": {"deepspeed": "zero3"},
                 "fsdp": {"fsdp": "full_shard"}}


def run_on_gpus(jobs: dict, gpus: int) -> dict:
    """Run independent single-GPU jobs (name -> fn(devices)) on `gpus` GPUs at once, one job per GPU
    at a time; returns name -> result."""
    import queue

    pending: queue.Queue = queue.Queue()
    for item in jobs.items():
        pending.put(item)
    results: dict = {}

    def worker(gpu: int) -> None:
        while True:
            try:
                name, fn = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[name] = fn(str(gpu))
            except Exception as exc:  # one failed job must not take its GPU out of the rotation
                results[name] = {"error": repr(exc)}

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in range(max(gpus, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class Suite:
    """The targets of docs/benchmarks.md: ours and the stock HF Trainer in the same call, each
    target printed with its ratio."""

    def __init__(self, work: Path, baseline: Path, steps: int, warm: int, out):
        self.work, self.baseline, self.steps, self.warm, self.out = work, baseline, steps, warm, out
        self.targets: list[dict] = []
        self.models: dict[str, Path] = {}
        self.lock = threading.Lock()  # runs on several GPUs report from their own threads

    def emit(self, row: dict) -> dict:
        line = json.dumps(row)
        with self.lock:
            print(line, flush=True)
            self.out.write(line + "\n")
            self.out.flush()
        return row

    def target(self, name: str, value, goal: float | None, extra: dict | None = None) -> None:
        """A ratio and its goal; without a goal, a figure to report (`met` None)."""
        met = None if goal is None else value is not None and value >= goal
        self.targets.append(self.emit({"target": name, "ratio": value, "goal": goal, "met": met, **(extra or {})}))

    def model(self, shape: str) -> Path:
        if shape not in self.models:
            self.models[shape] = build_model_dir(shape, self.work / f"model-{shape}", "bfloat16")
        return self.models[shape]

    def ours(self, shape, seq, bsz, lora, nproc=1, engine=None, extra=None, devices=None, **kw) -> dict:
        return self.emit(run_worker(self.work / (devices or "all"), self.model(shape), shape, seq, bsz, lora, True,
                                    nproc, self.steps, self.warm, engine or {}, "bfloat16", extra=extra,
                                    devices=devices, **kw))

    def single(self, gpus: int, groups: set[str]) -> None:
        """The single-GPU targets of `groups` (SINGLE_GROUPS). With several GPUs the runs share
        them, one run per GPU; the `alone` targets' runs follow, one at a time."""
        qwen, llama = ("qwen2.5-1.5b", 2048, 8), ("llama3.2-1b", 4096, 4)

        # A job is (the shape of our model it runs, None for HF's; fn(devices)).
        def hf(*config):
            return None, lambda dev: self.emit(run_baseline_config(self.baseline, config, devices=dev))

        def our_run(config, lora=False, **kw):
            return config[0], lambda dev: self.ours(*config, lora, devices=dev, **kw)

        full = lambda agent=False: our_run(qwen, agent=agent, **FAST_FULL)  # noqa: E731
        jobs = {
            "hf_qwen_full": hf(*qwen, False, True, False),
            "hf_llama_full": hf(*llama, False, True, False),
            "hf_qwen_lora": hf(*qwen, True, False, False),
            "qwen_full": full(),
            "llama_full": our_run(llama, **FAST_FULL),
            "qwen_lora": our_run(qwen, True, extra={"torch_compile": True}),
            "padded": our_run(qwen, min_len=50),
            "packed": our_run(qwen, min_len=50, extra={"packing": True, "attn_impl": "flex_attention"}),
            "agent_off_1": full(), "agent_on_1": full(agent=True), "agent_on_2": full(agent=True), "agent_off_2": full(),
        }
        for seq in LONG_SEQS:
            jobs[f"hf_long_{seq}"] = hf("llama3.2-1b", seq, 1, False, True, True)
            jobs[f"long_{seq}"] = our_run(("llama3.2-1b", seq, 1), engine=FAST_FULL["engine"],
                                          extra={**FAST_FULL["extra"], "gradient_checkpointing": True})
        targets = [t for t in SINGLE_TARGETS if t.group in groups]
        needed = {name for t in targets for pair in t.pairs for name in pair}
        alone = [name for t in targets if t.alone for name in t.run_order()]
        # The models the runs need, built before any starts: a build uses this process's GPU, which
        # may be timing another run.
        for shape in dict.fromkeys(job[0] for n, job in jobs.items() if n in needed and job[0]):
            self.model(shape)
        r = run_on_gpus({n: fn for n, (_, fn) in jobs.items() if n in needed and n not in alone}, gpus)
        r.update(run_on_gpus({n: jobs[n][1] for n in alone}, 1))
        for t in targets:
            ratios = [ratio(r[ours], r[theirs], t.key) for ours, theirs in t.pairs]
            extra = {"pairs": ratios} if len(ratios) > 1 else {}
            if t.memory:
                (ours, theirs), = t.pairs
                extra.update(peak_gib=r[ours].get("peak_mem_gib"), hf_peak_gib=r[theirs].get("peak_mem_gib"),
                             estimated_gib=r[ours].get("estimated_gib"))
            self.target(t.name, None if None in ratios else round(sum(ratios) / len(ratios), 3), t.goal, extra)

    def multi(self, nproc: int, modes: list[str], repeat: int = 1) -> None:
        """Each engine on `nproc` GPUs against hf_baseline_multi.py with the same engine and per-GPU
        batch. With `repeat` > 1 the pairs alternate their order (HF first, then ours first, ...)
        against drift, and the ratio is of the mean tokens/s."""
        best_ours, best_hf = {}, {}
        for mode in modes:
            pairs = [self.multi_pair(mode, nproc, hf_first=i % 2 == 0) for i in range(repeat)]
            ours, theirs = mean_run([pair[0] for pair in pairs]), mean_run([pair[1] for pair in pairs])
            extra = {"peak_gib": ours.get("peak_mem_gib"), "hf_peak_gib": theirs.get("peak_mem_gib")}
            if repeat > 1:
                extra["pairs"] = [ratio(*pair) for pair in pairs]
            self.target(f"{nproc} GPUs {mode}: qwen2.5-1.5b 2048x8 per GPU vs HF Trainer {mode}", ratio(ours, theirs),
                        1.10, extra)
            for best, row in ((best_ours, ours), (best_hf, theirs)):
                if "error" not in row and row["tokens_per_s"] > best.get("tokens_per_s", 0):
                    best.update(row, mode=mode)
        if best_ours and best_hf:
            self.target(f"{nproc} GPUs best: ours {best_ours['mode']} vs HF {best_hf['mode']}", ratio(best_ours, best_hf), 1.10)

    def multi_pair(self, mode: str, nproc: int, hf_first: bool) -> tuple[dict, dict]:
        """(ours, HF's) runs of one engine, in the order asked."""
        def theirs():
            return self.emit(run_baseline_multi(self.baseline.parent / "hf_baseline_multi.py", mode, nproc))

        def ours():
            # ZeRO-3's parameter hooks break graph capture: that engine runs uncompiled.
            return self.ours("qwen2.5-1.5b", 2048, 8, False, nproc=nproc, engine=MULTI_ENGINES[mode],
                             extra={"torch_compile": mode != "zero3"})

        if hf_first:
            first = theirs()
            return ours(), first
        return ours(), theirs()

    def variants(self, plan: Path) -> None:
        """Each line of `plan` is one run, printed as it ends:
        {"hf": [shape, seq, bsz, lora, liger, gradient_checkpointing]}   hf_baseline.py's run()
        {"hf_multi": "ddp|zero2|zero3|fsdp", "nproc": 2}                   hf_baseline_multi.py
        {"ours": {"shape": ..., "seq": ..., "bsz": ..., "lora": false, "nproc": 1,
                  "engine": {"deepspeed": "zero2"}, "extra": {"torch_compile": true}, "min_len": 50}}
        """
        for line in filter(str.strip, plan.read_text().splitlines()):
            item = json.loads(line)
            if "hf" in item:
                self.emit(run_baseline_config(self.baseline, tuple(item["hf"])))
            elif "hf_multi" in item:
                self.emit(run_baseline_multi(self.baseline.parent / "hf_baseline_multi.py", item["hf_multi"],
                                             item.get("nproc", 2)))
            else:
                run = item["ours"]
                self.ours(run["shape"], run["seq"], run["bsz"], run.get("lora", False), nproc=run.get("nproc", 1),
                          engine=run.get("engine"), extra=run.get("extra"), min_len=run.get("min_len"))

    def long_context(self, seqs: list[int], variants: list[str]) -> None:
        """LoRA r16 on the Llama-3.1-8B shape, micro-batch 1, gradient checkpointing and Liger on both
        sides: at each length HF (bench/hf_long_context.py, the stock stack's best), ours as it is,
        and ours with the tiled MLP and activation offload; the ratios against HF."""
        for seq in seqs:
            theirs = self.emit(run_baseline_config(LONG_BASELINE, ("llama3.1-8b", seq, 1, True, True, True,
                                                                    self.steps, self.warm)))
            for name in variants:
                extra = LONG_VARIANTS[name]
                ours = self.ours("llama3.1-8b", seq, 1, True, extra={"gradient_checkpointing": True, **extra})
                self.target(f"long context {seq // 1024}K, LoRA llama3.1-8b, {name} vs HF+peft+Liger+GC (bf16 base)",
                            ratio(ours, theirs), None if set(extra) & set(LONG_SAVERS) else 1.10,
                            {"peak_gib": ours.get("peak_mem_gib"), "hf_peak_gib": theirs.get("peak_mem_gib"),
                             "estimated_gib": ours.get("estimated_gib")})

    def longest(self, seqs: list[int]) -> None:
        """The longest of `seqs` (ascending) that trains, for HF and for ours with tiling and offload:
        each side runs up the list until a length fails (out of memory)."""
        for side in ("hf", "ours"):
            best = None
            for seq in seqs:
                if side == "hf":
                    row = self.emit(run_baseline_config(LONG_BASELINE, ("llama3.1-8b", seq, 1, True, True, True,
                                                                        self.steps, self.warm)))
                else:
                    row = self.ours("llama3.1-8b", seq, 1, True,
                                    extra={"gradient_checkpointing": True, **LONG_VARIANTS["tiled MLP + offload"]})
                if "error" in row:
                    break
                best = seq
            self.emit({"longest": side, "seq": best, "tried": seqs})

    def summary(self) -> str:
        verdict = {True: "MET ", False: "MISS", None: "COST"}
        return "\n".join(f"{verdict[t['met']]} {t['ratio']}x (goal {t['goal']}x) {t['target']}" for t in self.targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    parser.add_argument("--shapes", default=None, help="comma-separated subset of " + ", ".join(SHAPES))
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--fsdp", default=None)
    parser.add_argument("--baseline", type=Path, nargs="?", const=DEFAULT_BASELINE, default=None,
                        help=f"also run the HF Trainer baseline (default script {DEFAULT_BASELINE})")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--suite", type=Path, default=None, metavar="RESULTS.jsonl",
                        help="GPU: run the targets (--part, --targets, --modes) against the HF baselines, lines also to this file")
    parser.add_argument("--part", choices=("single", "multi", "all", "long", "longest"), default="all",
                        help="suite: the one-GPU targets, the multi-GPU engine targets (every GPU), or both; "
                             "long: the 8B long-context targets at --seqs; longest: the longest of --seqs that trains")
    parser.add_argument("--seqs", default=",".join(map(str, LONG_CONTEXT_SEQS)),
                        help="suite --part long/longest: sequence lengths, ascending")
    parser.add_argument("--long-variants", default=",".join(LONG_VARIANTS),
                        help="suite --part long: which of ours run (" + "; ".join(LONG_VARIANTS) + ")")
    parser.add_argument("--modes", default=",".join(MULTI_ENGINES), help="suite: engines of the multi-GPU part")
    parser.add_argument("--repeat", type=int, default=1, help="suite: HF/ours pairs per engine in the multi-GPU part")
    parser.add_argument("--targets", default=",".join(SINGLE_GROUPS), help="suite: targets of the single-GPU part")
    parser.add_argument("--variants", type=Path, default=None, metavar="PLAN.jsonl",
                        help="run the configurations listed in this file (see Suite.variants); lines also to --out")
    parser.add_argument("--out", type=Path, default=Path(os.devnull))
    args = parser.parse_args(argv)
    for flag, names, known in (("--targets", args.targets, SINGLE_GROUPS), ("--modes", args.modes, MULTI_ENGINES)):
        unknown = set(names.split(",")) - set(known)
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(sorted(unknown))} (choose from {', '.join(known)})")
    if args.repeat < 1:
        parser.error(f"--repeat: at least 1 pair per engine (got {args.repeat})")
    if args.suite and args.variants:
        parser.error("--suite and --variants: one at a time")

    plan = SMOKE_PLAN if args.smoke else PLAN
    if args.shapes:
        plan = [p for p in plan if p[0] in args.shapes.split(",")]
    steps, warm = (4, 1) if args.smoke else (args.steps, args.warm)
    dtype = "float32" if args.smoke else "bfloat16"
    engine = {k: v for k, v in (("deepspeed", args.deepspeed), ("fsdp", args.fsdp)) if v}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="swift-bench-"))
    try:
        import torch

        print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "torch": torch.__version__}), flush=True)
        if args.suite or args.variants:
            gpus = torch.cuda.device_count()
            if args.suite and args.part in ("multi", "all") and gpus < 2:
                print(f"the multi-GPU part needs 2+ GPUs (found {gpus})"
                      + (": not run" if args.part == "all" else ""), file=sys.stderr, flush=True)
                if args.part == "multi":
                    return 1  # before opening, so an earlier results file stays
            with open(args.suite or args.out, "w") as out:
                runs = Suite(work, args.baseline or DEFAULT_BASELINE, args.steps, args.warm, out)
                if args.variants:
                    runs.variants(args.variants)
                    return 0
                seqs = [int(v) for v in args.seqs.split(",")]
                if args.part == "long":
                    runs.long_context(seqs, args.long_variants.split(","))
                if args.part == "longest":
                    runs.longest(seqs)
                if args.part in ("single", "all"):
                    runs.single(gpus, set(args.targets.split(",")))
                if args.part in ("multi", "all") and gpus >= 2:
                    runs.multi(gpus, args.modes.split(","), args.repeat)
                print(runs.summary())
            return 0
        models: dict[str, Path] = {}
        for shape, seq, bsz, lora, liger in plan:
            if shape not in models:
                models[shape] = build_model_dir(shape, work / f"model-{shape}", dtype)
            print(json.dumps(run_worker(work, models[shape], shape, seq, bsz, lora, liger, args.nproc, steps, warm,
                                        engine, dtype)), flush=True)
        if args.baseline and not args.smoke:
            for shape, seq, bsz, lora, liger in plan:
                print(json.dumps(run_baseline_config(args.baseline, (shape, seq, bsz, lora, liger, False))), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
