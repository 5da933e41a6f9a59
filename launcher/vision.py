"""Vision-language models (transformers' image-text-to-text models): the image side of their data.

A record's `<image>` tags become image parts of its messages, which the model's chat template
renders as its image placeholder (Qwen's `<|vision_start|><|image_pad|><|vision_end|>`, InternVL's
`<IMG_CONTEXT>`); each image's placeholder token is then repeated once per visual token the model
gives that image, as the model's processor does: the image processor's patch count for the image's
size (read from the file's header when tokenizing, so the cache holds the final ids), over the
merge of patches into tokens (Qwen's and GLM-4V's); for InternVL its tiles' count times each tile's
tokens, the run between `<img>` and `</img>`. The pixels are decoded and processed per micro-batch.
The processor class itself is not used: transformers 5.24 cannot build a Qwen2-VL processor without
torchvision (its video processor lookup fails), while the image processor falls back to its PIL
backend."""
from __future__ import annotations

import hashlib
import json
import re

import torch

from backend.job.errors import UserError
from backend.job.modelcfg import TILED_FAMILIES, VISION_FAMILIES
from backend.job.records import IMAGE_TAG, DataError, open_image, shown_image

ORIENTATION = 0x0112  # the EXIF tag


def is_vision(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def model_config(path: str):
    """The model's transformers config where it is a vision-language model, else None (also where
    it cannot be read: loading the tokenizer names that)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
    return config if is_vision(config) else None


def auto_class(path: str):
    """transformers' Auto class for the model at `path`: image-text-to-text for a vision-language
    model, causal LM otherwise (raises OSError or ValueError as from_pretrained does)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM


def save_image_processor(source: str, out, max_pixels: int | None = None) -> None:
    """A vision-language model's image processor saved beside its export (from_pretrained reads it
    there), with the `max_pixels` it was trained with."""
    config = model_config(source)
    if config is not None:
        image_processor(source, config, max_pixels).save_pretrained(out)


FRAME_BOUNDED = ("glm4v",)
"""Families whose image processor bounds an image's pixels times its temporal patch (an image as
that many frames)."""


def image_processor(source: str, config, max_pixels: int | None = None):
    """The model's image processor, an image's pixels bounded by `max_pixels` where given: its size's
    longest_edge (FRAME_BOUNDED families: times the temporal patch)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(source)
    if not max_pixels:
        return processor
    if "longest_edge" not in processor.size:
        raise UserError(f"max_pixels: {type(processor).__name__} cuts images into tiles of a fixed size; it takes no "
                        "pixel bound (its max_patches caps the tiles)")
    frames = processor.temporal_patch_size if config.model_type in FRAME_BOUNDED else 1
    return AutoImageProcessor.from_pretrained(source, size={"shortest_edge": processor.size["shortest_edge"],
                                                            "longest_edge": max_pixels * frames})


def with_image_parts(messages: list[dict]) -> list[dict]:
    """String contents with `<image>` tags as content parts (image, text), as chat templates of
    vision-language models take them."""
    out = []
    for message in messages:
        content = message["content"]
        if IMAGE_TAG not in content:
            out.append(message)
            continue
        parts = []
        for i, text in enumerate(content.split(IMAGE_TAG)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    return out


TILE_BOUNDS = ("<img>", "</img>")


class Images:
    """The model's image processor (`max_pixels` caps an image's size) and image placeholder token."""

    def __init__(self, model_dir: str, config, max_pixels: int | None = None):
        if config.model_type not in VISION_FAMILIES:
            raise UserError(f"model: {config.model_type} is not a vision-language family the worker trains yet "
                            f"(it does {', '.join(VISION_FAMILIES)})")
        self.processor = image_processor(model_dir, config, max_pixels)
        self.token_id = config.image_token_id
        self.merge = getattr(self.processor, "merge_size", 1)
        self.tiled = config.model_type in TILED_FAMILIES
        self.bounds: tuple[int, ...] = ()
        """The tokens around an image's run that the processor adds (InternVL's `<img>`, `</img>`)."""
        if self.tiled:
            from transformers import AutoTokenizer

            vision = config.vision_config
            side, patch = (v[0] if isinstance(v, (list, tuple)) else v for v in (vision.image_size, vision.patch_size))
            self.per_tile = round((side // patch) ** 2 * config.downsample_ratio ** 2)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.bounds = tuple(tokenizer.convert_tokens_to_ids(list(TILE_BOUNDS)))
            if tokenizer.unk_token_id in self.bounds or None in self.bounds:
                raise UserError(f"model: {model_dir}'s tokenizer has no {' and '.join(TILE_BOUNDS)} tokens, which "
                                f"{config.model_type} puts around each image's visual tokens")
        self.ids = {self.token_id, *self.bounds}
        """Every token an image's run takes."""
        self.rope_index = None
        """The model's multimodal rope (Qwen's and GLM-4V's `get_rope_index`; `bind`): packed rows' positions."""

    def bind(self, model) -> None:
        """Takes the model's own multimodal rope, by which packed rows place each sample's image tokens
        (InternVL places them as text and has none)."""
        if not self.tiled:
            self.rope_index = next(module.get_rope_index for module in model.modules()
                                   if callable(getattr(type(module), "get_rope_index", None)))

    def placeholder(self, count: int) -> list[int]:
        """An image's tokens for `count` visual tokens."""
        run = [self.token_id] * count
        return [self.bounds[0], *run, self.bounds[1]] if self.bounds else run

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model takes beside the pixels: Qwen's and GLM-4V's token types, from which
        transformers 5.24 computes their multimodal rope (InternVL places image tokens as text)."""
        return {} if self.tiled else {"mm_token_type_ids": (input_ids == self.token_id).int()}

    def packed_positions(self, input_ids: torch.Tensor, text_positions: torch.Tensor,
                         grids: torch.Tensor | None) -> torch.Tensor:
        """Positions of packed rows (samples end to end, `text_positions` restarting at 0 with each) as
        transformers' Qwen-VL and GLM-4V language models take them, (4, rows, width): the text positions,
        from which the block-diagonal mask is built, over each sample's multimodal rope computed by the
        model on that sample alone (a padding tail is a sample of text). `grids`: the rows' images'
        `image_grid_thw`, in order."""
        segments = [(row, int(start), int(end))
                    for row, positions in enumerate(text_positions)
                    for start, end in zip(*_runs_from_zeros(positions))]
        longest = max(end - start for _, start, end in segments)
        ids = torch.zeros(len(segments), longest, dtype=input_ids.dtype)
        mask = torch.zeros(len(segments), longest, dtype=torch.long)
        for i, (row, start, end) in enumerate(segments):
            ids[i, :end - start], mask[i, :end - start] = input_ids[row, start:end], 1
        rope, _ = self.rope_index(ids, mm_token_type_ids=self.inputs(ids)["mm_token_type_ids"] * mask,
                                  image_grid_thw=grids, attention_mask=mask)
        out = torch.zeros(3, *input_ids.shape, dtype=rope.dtype)
        for i, (row, start, end) in enumerate(segments):
            out[:, row, start:end] = rope[:, i, :end - start]
        return torch.cat([text_positions[None].to(out.dtype), out])

    def digest(self) -> str:
        """What the visual token counts depend on (the tokenized cache's key)."""
        return hashlib.sha256(json.dumps(self.processor.to_dict(), sort_keys=True, default=str).encode()).hexdigest()

    def tokens(self, where: str, path: str) -> int:
        """How many placeholder tokens the image at `path` takes (its header read, not its pixels)."""
        with open_image(where, path) as image:
            width, height = image.size
            try:  # a PNG's EXIF is read by loading it: a truncated file fails here
                turned = image.getexif().get(ORIENTATION) in (5, 6, 7, 8)
            except OSError as exc:
                raise DataError(f"{where}: image {shown_image(path)} cannot be decoded ({exc})") from None
            if turned:  # shown turned a quarter (`pixels` turns it)
                width, height = height, width
        try:
            patches = self.processor.get_number_of_image_patches(height, width, {})
        except ValueError as exc:  # the processor's own limits (an aspect ratio over 200)
            raise DataError(f"{where}: image {shown_image(path)}: {exc}") from None
        return patches * self.per_tile if self.tiled else patches // self.merge ** 2

    def pixels(self, images: list[tuple[str, int]], where: str = "training data") -> dict[str, torch.Tensor]:
        """The processor's inputs for a micro-batch's images, each (path, the tokens it was tokenized
        with): a count that no longer holds (the file changed since) is an error that names it."""
        from PIL import ImageOps

        decoded = []
        for path, _ in images:
            with open_image(where, path) as image:
                try:
                    # turned as its EXIF orientation says, as transformers' load_image shows it at inference
                    decoded.append(ImageOps.exif_transpose(image).convert("RGB"))
                except OSError as exc:  # a truncated or corrupt file fails when its pixels are read
                    raise DataError(f"{where}: image {shown_image(path)} cannot be decoded ({exc})") from None
        out = self.processor(images=decoded, return_tensors="pt")
        if self.tiled:
            counts = [int(n) * self.per_tile for n in out["num_patches"]]
        else:
            counts = [t * h * w // self.merge ** 2 for t, h, w in out["image_grid_thw"].tolist()]
        for (path, tokens), count in zip(images, counts):
            if count != tokens:
                raise DataError(f"{where}: image {shown_image(path)} is not the size it had when the data was tokenized; "
                                "tokenize again (a new dataset_cache_dir, or remove the cache entry)")
        if self.tiled:
            return {"pixel_values": out["pixel_values"]}
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def runs(self, ids: list[int]) -> list[int]:
        """The lengths of the image placeholder runs in `ids`: each image's token count, in order."""
        out, run = [], 0
        for token in ids + [None]:
            if token == self.token_id:
                run += 1
            elif run:
                out.append(run)
                run = 0
        return out


def _runs_from_zeros(positions: torch.Tensor) -> tuple[list[int], list[int]]:
    """(starts, ends) of the runs of a row's positions, each starting at 0."""
    starts = (positions == 0).nonzero().flatten().tolist()
    return starts, starts[1:] + [len(positions)]


def vision_parts(model) -> tuple[list[torch.nn.Module], list[torch.nn.Module], list[torch.nn.Module]]:
    """(vision tower, aligner, language model) of a vision-language model: Qwen's and GLM-4V's
    `visual` module less its mergers, its mergers (patch merger, and Qwen3-VL's deepstack ones);
    InternVL's `vision_tower` and its `multi_modal_projector`; and the language model with its head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base.model, "visual"):
        return [base.model.vision_tower], [base.model.multi_modal_projector], [base.model.language_model, base.lm_head]
    visual = base.model.visual
    aligner = [m for name in ("merger", "deepstack_merger_list") if (m := getattr(visual, name, None)) is not None]
    vit = [m for m in visual.children() if all(m is not a for a in aligner)]
    return vit, aligner, [base.model.language_model, base.lm_head]


def part_learning_rates(model, spec) -> dict[int, float]:
    """The learning rate of each parameter (by id) of the vision tower and the aligner where the job
    gives them their own (vit_lr, aligner_lr: ms-swift's optimizer groups); {} otherwise. `model` as
    the engine holds it: DDP's wrapper is looked through, FSDP2's and DeepSpeed's keep its modules."""
    model = getattr(model, "module", model)
    if (spec.vit_lr is None and spec.aligner_lr is None) or not is_vision(getattr(model, "config", None)):
        return {}
    vit, aligner, _ = vision_parts(model)
    return {id(p): lr for lr, modules in ((spec.vit_lr, vit), (spec.aligner_lr, aligner)) if lr is not None
            for module in modules for p in module.parameters()}


def lora_targets(model, spec, names: list[str] | None = None) -> str:
    """peft's target_modules (a regex over module names) for the linear layers named `names` (by their
    last name part; None: all of them, what 'all-linear' means here) of the parts that train: the
    language model (less its head) unless freeze_llm, the vision tower unless freeze_vit, the aligner
    unless freeze_aligner (ms-swift's rule); LoRA stays off a frozen part, though the tower's blocks
    share names like `gate_proj` with the language model's. A ValueError where named targets leave
    a part that trains without adapters."""
    vit, aligner, llm = vision_parts(model)
    alternatives = []
    for label, frozen, modules in (("the language model", spec.freeze_llm, llm[:1]), ("the vision tower", spec.freeze_vit, vit),
                                   ("the aligner", spec.freeze_aligner, aligner)):
        if frozen:
            continue
        found = []
        for prefix, part in ((n, m) for n, m in model.named_modules() if any(m is module for module in modules)):
            # each part's own linear layers' names: a name of another part's (the tower's `proj`) may
            # be a convolution here (its patch embedding's `proj`)
            linear = {n.rsplit(".", 1)[-1] for n, m in part.named_modules() if isinstance(m, torch.nn.Linear)}
            wanted = sorted(linear & set(names)) if names else sorted(linear)
            found += linear
            if wanted:
                alternatives.append(rf"{re.escape(prefix)}(\..*)?\.({'|'.join(map(re.escape, wanted))})")
        if names and not set(found) & set(names):
            raise ValueError(f"{', '.join(names)} name no linear layer of {label}, which trains here; name its own "
                             f"({', '.join(sorted(set(found)))}) too, use all-linear, or freeze it")
    return "|".join(alternatives)
