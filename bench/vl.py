"""A vision-language model on the worker against HF Trainer + peft (bench/hf_vl.py) in the same call:
the Qwen2.5-VL-3B shape with random weights (bf16), Qwen2-VL's image processor, images of 448x448
(256 visual tokens each) with long answers, issue 33's targets; or the Qwen3-VL-4B shape (196 visual
tokens an image).

    python bench/vl.py --out vl.jsonl                    # GPU: every part but profile
    python bench/vl.py --parts lora --steps 10 --warm 3  # one part
    python bench/vl.py --parts lora --shape qwen3-vl-4b  # the other family
    python bench/vl.py --smoke                           # CPU, a tiny model: the pipeline end to end

Parts:
  lora   LoRA r16 on the language model's linear layers, vision tower and aligner frozen (ms-swift's
         freeze_vit / freeze_aligner defaults; peft's targets named the same on the HF side): HF Trainer
         with and without Liger's kernels against ours eager and with torch_compile (their losses by
         step compared); the target compares the fastest of each side,
         and their peak memory, and the memory estimate against our peak.
  tp     ours, LoRA with the language model under transformers' TP plan: 2 ranks sharing the GPU
         against 1 rank, the same micro-batch, losses by step.
  packed ours, LoRA with packing against the same records unpacked: tokens/s, peaks, estimates.
  textonly  ours, the lora part's job with each image's tokens as text: the tower's share of the peak.
  tower  ours, LoRA with freeze_vit off against the tower frozen (half the micro-batch): the estimate of
         a training tower's activations and adapters.
  profile  HF's side of the lora part under torch.profiler: its kernel table and GPU time a step.
  ranks  ours, LoRA under DeepSpeed ZeRO-3: 2 ranks sharing the GPU (each its own NCCL host) against 1
         rank with the same global batch, every record the same sample (each data-parallel rank reads
         its own shard in its own order, so distinct samples would make different steps), losses by step.

Tokens/s count every non-padding token of a micro-batch, the visual placeholders included, on both sides.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Compared, driver_parser, parts_of  # noqa: E402
from throughput import ROOT, estimated_gib, torchrun_argv  # noqa: E402

from backend.job.modelcfg import VIDEO_FAMILIES  # noqa: E402

HF = Path(__file__).resolve().parent / "hf_vl.py"
# A family's (image start, image end, image placeholder, video placeholder) tokens: an image part
# renders as start + placeholder + end, and the processor repeats the placeholder.
VISION_TOKENS = {"glm4v": ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>"),
                 # InternVL's template renders the placeholder alone: its processor adds <img> and </img>
                 "internvl": ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")}
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vl_template(start: str, end: str, image: str, video: str | None = None) -> str:
    """Qwen2-VL's chat template, less its default system prompt, with a family's image tokens (and
    its video token, where it renders video parts)."""
    video_part = f"{{% elif part['type'] == 'video' %}}{{{{ '{start}{video}{end}' }}}}" if video else ""
    return ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
            f"{{{{ '{start}{image}{end}' }}}}{video_part}{{% elif part['type'] == 'text' %}}{{{{ part['text'] }}}}"
            "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# (family, language model, vision tower, image processor's pixel bounds)
SHAPES = {
    "qwen2.5-vl-3b": ("qwen2_5_vl",
                      dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                           num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=128000,
                           rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                      dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
                      (56 * 56, 448 * 448)),
    # Qwen3-VL-4B's widths: 16 px patches (a 448x448 image: 196 visual tokens), deepstack mergers
    "qwen3-vl-4b": ("qwen3_vl",
                    dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=5000000.0,
                         max_position_embeddings=262144,
                         rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
                    dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                         patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                         deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
                    (64 * 64, 448 * 448)),
    "smoke": ("qwen2_5_vl",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096,
                   rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
              dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
              (56 * 56, 112 * 112)),
}


def build_vl_model(out: Path, family: str, text: dict, vision: dict, pixels: tuple[int, int],
                   dtype: str = "float32", device: str | None = None) -> Path:
    """A Qwen-VL family, GLM-4V or InternVL model with random weights (seeded) from `text` and
    `vision` config fields, the demo tokenizer plus the family's image tokens and a chat template that
    renders image parts, and its image processor (the PIL backend, which needs no torchvision) within
    `pixels` (min, max; InternVL: tiles of the tower's image_size, at most `pixels[1]` // its area of
    them); built on `device` (default: the GPU where there is one)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokens = VISION_TOKENS.get(family, QWEN_VISION_TOKENS)
    # InternVL's processor finds its tokens by these names on the tokenizer, as its -hf checkpoints name them
    named = dict(zip(("start_image_token", "end_image_token", "context_image_token", "video_token"), tokens))
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model",
                                              **({"extra_special_tokens": named} if family == "internvl" else {}))
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.chat_template = vl_template(*(("", "", *tokens[2:]) if family == "internvl" else
                                            tokens if family in VIDEO_FAMILIES else tokens[:3]))
    tokenizer.save_pretrained(out)
    if family == "internvl":
        side = vision["image_size"][0]
        GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=True, min_patches=1,
                                 max_patches=max(1, pixels[1] // side ** 2)).save_pretrained(out)
        # as its checkpoints: a frame a tile of the tower's side (written, not built: building the video
        # processor needs torchvision)
        (out / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "InternVLVideoProcessor", "size": {"height": side, "width": side},
            "initial_shift": True}, indent=2))
    else:
        processor = Glm4vImageProcessorPil if family == "glm4v" else Qwen2VLImageProcessorPil
        processor(patch_size=vision["patch_size"], size={"shortest_edge": pixels[0], "longest_edge": pixels[1]}
                  ).save_pretrained(out)
    if family == "qwen3_vl":
        # as its checkpoints, its own video processor's file (written, not built: building it needs
        # torchvision): bounds of a whole video's pixels, here 16 frames' at the images' largest
        (out / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"], "merge_size": vision["spatial_merge_size"],
            "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1] * 16}}, indent=2))
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(tokens))
    text = {"vocab_size": len(tokenizer), "tie_word_embeddings": True, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, **text}
    ids = ({} if family == "internvl" else dict(image_start_token_id=start, image_end_token_id=end)
           if family == "glm4v" else dict(vision_start_token_id=start, vision_end_token_id=end))
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=image,
                                  video_token_id=video, tie_word_embeddings=True, **ids)
    if family == "internvl":  # its processor's tokens a tile, as its checkpoints' file gives them
        tile = (vision["image_size"][0] // vision["patch_size"][0]) ** 2 * config.downsample_ratio ** 2
        (out / "processor_config.json").write_text(json.dumps({"processor_class": "InternVLProcessor",
                                                               "image_seq_length": round(tile)}, indent=2))
    torch.manual_seed(0)
    with torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")):
        model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()  # as throughput.build_model_dir: the measured runs are other processes
    return out


def write_images(directory: Path, n: int, side: int, answer_chars: int, same: bool = False,
                 text_for_image: int = 0) -> Path:
    """An image data file in ms-swift's format: `n` records, each a side x side PNG of random shapes
    and colours with a question and an answer of random words of about `answer_chars` characters
    (the demo tokenizer: about 1.1 tokens a character); `same`: every record the first one;
    `text_for_image`: no images, the question that many characters of words longer instead."""
    from PIL import Image, ImageDraw

    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = []
    for i in range(n):
        if same and lines:
            lines.append(lines[0])
            continue
        image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = rng.randrange(side), rng.randrange(side)
            draw.ellipse((x, y, x + rng.randrange(20, side // 2), y + rng.randrange(20, side // 2)),
                         fill=tuple(rng.randrange(256) for _ in range(3)))
        image.save(directory / f"{i}.png")
        answer = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                          for _ in range(rng.randint(answer_chars // 6, answer_chars // 4)))
        if text_for_image:
            words = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(text_for_image))
            lines.append(json.dumps({"messages": [{"role": "user", "content": words + " Describe the picture."},
                                                  {"role": "assistant", "content": answer}]}))
            continue
        lines.append(json.dumps({"messages": [{"role": "user", "content": "<image>Describe the picture."},
                                              {"role": "assistant", "content": answer}], "images": [f"{i}.png"]}))
    path = directory / "images.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def vl_config(shape: str) -> dict:
    """The config.json build_vl_model writes for `shape` (its token ids aside): what the estimate reads."""
    from transformers import AutoConfig

    family, text, vision, _ = SHAPES[shape]
    return AutoConfig.for_model(family, text_config={"tie_word_embeddings": True, **text}, vision_config=vision,
                                tie_word_embeddings=True).to_dict()


def our_job(model: Path, data: Path, seq: int, max_pixels: int, bsz: int, steps: int, dtype: str, **fields) -> dict:
    """LoRA r16 on the language model (ms-swift's freeze_vit / freeze_aligner defaults), every step
    logged, no checkpoints, no activation recomputation (the HF side runs without)."""
    return {**dict(model=str(model), dataset=[str(data)], train_type="lora", max_length=seq, max_pixels=max_pixels,
                   per_device_train_batch_size=bsz, max_steps=steps, logging_steps=1, save_strategy="no",
                   learning_rate=1e-4, torch_dtype=dtype, gradient_checkpointing=False, lora_rank=16, lora_alpha=32,
                   lora_dropout=0.0), **fields}


class Bench(Compared):
    def __init__(self, work: Path, steps: int, warm: int, out, smoke: bool, answer_chars: int, shape: str):
        super().__init__(work, steps, warm, out, smoke)
        self.dtype = "float32" if smoke else "bfloat16"
        self.shape = "smoke" if smoke else shape
        family, text, vision, self.pixels = SHAPES[self.shape]
        self.merged_patch = vision["patch_size"] * vision["spatial_merge_size"]  # an image's side per visual token
        self.side = 112 if smoke else 448
        self.seq = 256 if smoke else 1024
        self.answer_chars = 100 if smoke else answer_chars
        self.model = build_vl_model(work / "model", family, text, vision, self.pixels, self.dtype)

    def data(self, n: int, same: bool = False, text_only: bool = False) -> Path:
        """`text_only`: the records with text of about an image's tokens in its place."""
        directory = self.work / f"images-{n}{'-same' if same else ''}{'-text' if text_only else ''}"
        if directory.exists():
            return directory / "images.jsonl"
        visual = (self.side // self.merged_patch) ** 2  # tokens of a side x side image
        return write_images(directory, n, self.side, self.answer_chars, same, int(visual / 1.1) if text_only else 0)

    def hf_argv(self, bsz: int, liger: bool) -> list[str]:
        return torchrun_argv(1, str(HF), str(self.model), str(self.data(bsz * (self.steps + 1))), "--seq", str(self.seq),
                             "--bsz", str(bsz), "--steps", str(self.steps), "--warm", str(self.warm),
                             "--max-pixels", str(self.pixels[1]), *["--liger"] * liger)

    def hf(self, bsz: int, liger: bool) -> dict:
        return self.baseline(self.hf_argv(bsz, liger), dict(source="hf+peft", liger=liger))

    def profile(self, bsz: int) -> None:
        """HF's side of the lora part (without Liger) under torch.profiler: its kernel table and GPU
        time a step, printed (where its step's time goes; profiled steps run slower)."""
        proc = subprocess.run(self.hf_argv(bsz, liger=False) + ["--profile", "30"], capture_output=True, text=True,
                              env={**os.environ, "TMPDIR": str(self.work)})
        print(proc.stdout[-30000:] if proc.returncode == 0 else proc.stderr[-5000:], flush=True)

    def ours(self, name: str, bsz: int, nproc: int = 1, same: bool = False, text_only: bool = False,
             data_bsz: int | None = None, **fields) -> dict:
        """`data_bsz`: the records a step reads, where a row packs several (default `bsz`)."""
        data = self.data((data_bsz or bsz) * nproc * (self.steps + 1), same, text_only)
        spec = our_job(self.model, data, self.seq, self.pixels[1], bsz, self.steps, self.dtype, **fields)
        timing, train = self.worker(name, spec, nproc)
        row = dict(source="swift-studio", name=name, shape=self.shape, nproc=nproc, seq=self.seq, bsz=bsz, **fields)
        if "error" in timing:
            return self.emit({**row, **timing})
        tokens = timing.pop("tokens_per_step")
        config = json.loads((self.model / "config.json").read_text())
        samples = (data_bsz or bsz) * nproc // fields.get("tensor_model_parallel_size", 1)  # TP ranks share theirs
        return self.emit({**row, **timing, "tokens_per_sample": tokens / samples,
                          "estimated_gib": estimated_gib(self.work / name, self.shape, nproc, config),
                          "losses": [e["loss"] for e in train]})

    def lora(self, bsz: int) -> None:
        theirs = [self.hf(bsz, liger) for liger in ([False] if self.smoke else [True, False])]
        ours = [self.ours("lora", bsz)] + ([] if self.smoke else [self.ours("lora-compiled", bsz, torch_compile=True)])
        if len(ours) == 2 and not any("error" in r for r in ours):
            eager, compiled = ours
            self.emit({"target": "VL LoRA: torch_compile's losses vs eager's, by step", "max_rel_loss_diff": float(
                f"{max(abs(a - b) / abs(a) for a, b in zip(eager['losses'], compiled['losses'])):.3g}")})
        ok = [r for r in ours if "error" not in r], [r for r in theirs if "error" not in r]
        if not all(ok):
            self.emit({"target": "VL LoRA", "ratio": None, "why": "a side has no run"})
            return
        best_ours, best_hf = (max(rows, key=lambda r: r["tokens_per_s"]) for rows in ok)
        ratio = round(best_ours["tokens_per_s"] / best_hf["tokens_per_s"], 3)
        self.emit({"target": f"VL LoRA r16 {self.shape} {self.side}px images x{bsz}: ours vs HF Trainer + peft (best)",
                   "ratio": ratio, "goal": 1.15,
                   "met": ratio >= 1.15 and (self.smoke or best_ours["peak_mem_gib"] <= best_hf["peak_mem_gib"]),
                   "hf_liger": best_hf.get("liger"), "peak_gib": best_ours["peak_mem_gib"],
                   "hf_peak_gib": best_hf.get("peak_mem_gib"), "estimated_gib": best_ours["estimated_gib"],
                   "estimate_error": round(best_ours["estimated_gib"] / best_ours["peak_mem_gib"] - 1, 3)})

    def ranks(self, bsz: int) -> None:
        self.same_losses("VL LoRA ZeRO-3: 2 ranks x {half} vs 1 rank x {bsz}, by step", bsz,
                         self.ours("ranks-zero3-1", bsz, same=True, deepspeed="zero3"),
                         self.ours("ranks-zero3-2", bsz // 2, nproc=2, same=True, deepspeed="zero3"))

    def tp(self, bsz: int) -> None:
        """transformers' TP plan for the language model on 2 ranks sharing the GPU (one data-parallel
        rank: the same micro-batch) against 1 rank."""
        self.same_losses("VL LoRA TP=2 x {bsz} vs 1 rank x {bsz}, by step", bsz, self.ours("tp-1", bsz, same=True),
                         self.ours("tp-2", bsz, nproc=2, same=True, tensor_model_parallel_size=2))

    def same_losses(self, target: str, bsz: int, one: dict, two: dict) -> None:
        """Two runs of the same records' steps: their losses by step."""
        target = target.format(bsz=bsz, half=bsz // 2)
        if "error" in one or "error" in two:
            self.emit({"target": target, "met": False})
            return
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(one["losses"], two["losses"]))
        self.emit({"target": target, "max_rel_loss_diff": float(f"{worst:.3g}"), "one": one["losses"],
                   "two": two["losses"]})

    def packed(self, bsz: int) -> None:
        """Packing's rows (images' tokens and rope positions per sample), one row of `bsz` times the
        sequence length, against `bsz` rows of the same records unpacked, each with its memory estimate."""
        plain = self.ours("unpacked", bsz)
        packed = self.ours("packed", 1, packing=True, max_length=bsz * self.seq, data_bsz=bsz)
        if "error" not in plain and "error" not in packed:
            self.emit({"target": f"VL LoRA x {bsz}: packed vs unpacked", "speedup": round(
                packed["tokens_per_s"] / plain["tokens_per_s"], 3), **{
                f"{name}_{key}": row[key] for name, row in (("packed", packed), ("unpacked", plain))
                for key in ("tokens_per_s", "peak_mem_gib", "estimated_gib")}, "estimate_error": round(
                packed["estimated_gib"] / packed["peak_mem_gib"] - 1, 3)})

    def textonly(self, bsz: int) -> None:
        """Where the memory goes: ours on the same model with each image's tokens as text (the tower
        idle), against the image run of the lora part."""
        text = self.ours("lora-text-only", bsz, text_only=True)
        image = next((r for r in self.done if r.get("name") == "lora"), None) or self.ours("lora", bsz)
        if "error" not in text and "error" not in image:
            self.emit({"target": "VL LoRA: images vs their tokens as text", "peak_gib": image["peak_mem_gib"],
                       "text_peak_gib": text["peak_mem_gib"], "tokens_per_sample": image["tokens_per_sample"],
                       "text_tokens_per_sample": text["tokens_per_sample"], "estimated_gib": image["estimated_gib"]})

    def tower(self, bsz: int) -> None:
        """The memory estimate of a training tower: LoRA with freeze_vit off (adapters on the tower's
        blocks, their activations kept) against the same job with the tower frozen, half the lora
        part's micro-batch (the tower's activations would not fit an H100 beside the rest)."""
        frozen = self.ours("tower-frozen", bsz // 2)
        trained = self.ours("tower-lora", bsz // 2, freeze_vit=False)
        if "error" not in frozen and "error" not in trained:
            self.emit({"target": "VL LoRA: the tower trained vs frozen", "peak_gib": trained["peak_mem_gib"],
                       "frozen_peak_gib": frozen["peak_mem_gib"], "estimated_gib": trained["estimated_gib"],
                       "frozen_estimated_gib": frozen["estimated_gib"],
                       "estimate_error": round(trained["estimated_gib"] / trained["peak_mem_gib"] - 1, 3)})


PARTS = ("lora", "ranks", "tp", "packed", "textonly", "tower", "profile")


def main() -> int:
    parser = driver_parser(__doc__, PARTS, ",".join(p for p in PARTS if p != "profile"))
    parser.add_argument("--answer-chars", type=int, default=480, help="about how long an answer is (460-680 tokens)")
    parser.add_argument("--shape", default="qwen2.5-vl-3b", choices=[name for name in SHAPES if name != "smoke"])
    args = parser.parse_args()
    parts = parts_of(parser, args, PARTS)
    work = Path(tempfile.mkdtemp(prefix="vl-bench-"))
    steps, warm = (4, 1) if args.smoke else (args.steps, args.warm)
    try:
        with open(args.out, "w") as out:
            bench = Bench(work, steps, warm, out, args.smoke, args.answer_chars, args.shape)
            for part in parts:
                getattr(bench, part)(args.ranks_bsz if part in ("ranks", "tp", "packed") else (2 if args.smoke else args.bsz))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
