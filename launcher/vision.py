"""Vision-language models (transformers' image-text-to-text models): the image side of their data.

A record's `<image>` tags become image parts of its messages, which the model's chat template
renders as its image placeholder (Qwen's `<|vision_start|><|image_pad|><|vision_end|>`, InternVL's
`<IMG_CONTEXT>`); each image's placeholder token is then repeated once per visual token the model
gives that image, as the model's processor does: the image processor's patch count for the image's
size (read from the file's header when tokenizing, so the cache holds the final ids), over the
merge of patches into tokens (Qwen's and GLM-4V's); for InternVL its tiles' count times each tile's
tokens, the run between `<img>` and `</img>`. A `<video>` tag (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
InternVL) is a video part, its placeholder replaced by the model processor's own layout of the frames
its video processor samples (Qwen's: FPS a second, at most fps_max_frames; InternVL's: video_segments
frames, the middle one of each equal segment, each one tile; from the file's header when tokenizing):
one run of placeholders, Qwen3-VL's `<t seconds>` text and a run per temporal patch, or InternVL's
`FrameN: ` text and an image's run per frame. The pixels are
decoded and processed per micro-batch, videos' frames by PyAV. The processor class itself is used
for videos alone: transformers 5.24 cannot build a Qwen2-VL processor without torchvision (its video
processor lookup fails), while the image processor falls back to its PIL backend; the video processor
needs torchvision, and both are built at a job's first video."""
from __future__ import annotations

import hashlib
import importlib
import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from backend.job.errors import UserError
from backend.job.modelcfg import TILED_FAMILIES, VIDEO_FAMILIES, VISION_FAMILIES
from backend.job.records import (IMAGE_TAG, MEDIA_TAGS, VIDEO_TAG, DataError, Persona, ReaderMissing, VideoHeader,
                                 decode_video, open_image, shown_image, video_header)

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


def save_image_processor(source: str, out, spec) -> None:
    """A vision-language model's image processor saved beside its export (from_pretrained reads it
    there), with the `max_pixels` it was trained with; its video processor too where the job bounded
    videos (video_max_pixels, fps_max_frames, video_segments; unbounded, it reads the image processor's
    files)."""
    config = model_config(source)
    if config is None:
        return
    image_processor(source, config, spec.max_pixels).save_pretrained(out)
    if config.model_type not in VIDEO_FAMILIES:
        return
    try:
        videos = Videos(source, spec.video_max_pixels, spec.fps_max_frames, spec.video_segments)
    except (ImportError, RuntimeError, OSError, ValueError) as exc:
        if spec.video_max_pixels or spec.fps_max_frames or spec.video_segments:
            raise UserError(f"video_max_pixels, fps_max_frames, video_segments: the export saves the video processor "
                            f"with them, which needs torchvision matching torch here ({exc})") from None
        return  # no torchvision here: a video processor loaded from the export reads the image processor's file
    # always: without a file of its own, a video processor loaded from the export would read the image
    # processor's, which holds the job's max_pixels, not the bounds the run's videos were sized by
    videos.processor.save_pretrained(out)


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


_TAGS = re.compile(f"({'|'.join(map(re.escape, MEDIA_TAGS.values()))})")
_IMAGE_TAG = re.compile(f"({re.escape(IMAGE_TAG)})")
_PART = {IMAGE_TAG: "image", VIDEO_TAG: "video"}


def with_image_parts(messages: list[dict], videos: bool = False) -> list[dict]:
    """String contents with `<image>` tags (and `<video>` tags, `videos`; else they stay text) as
    content parts (image, video, text), as chat templates of vision-language models take them."""
    tags = _TAGS if videos else _IMAGE_TAG
    out = []
    for message in messages:
        content = message["content"]
        if not tags.search(content):
            out.append(message)
            continue
        parts = [{"type": _PART[piece]} if piece in _PART else {"type": "text", "text": piece}
                 for piece in tags.split(content) if piece]
        out.append({**message, "content": parts})
    return out


FPS = 2.0
"""Frames a second sampled from a video: ms-swift's FPS default (qwen-vl-utils')."""
VIDEO_MAX_PIXELS = 768 * 28 * 28
"""A frame's pixels at most where the job sets no video_max_pixels: ms-swift's VIDEO_MAX_PIXELS default
(the checkpoints' own files bound images only, Qwen2.5-VL's at 12.8 megapixels)."""
VIDEO_SEGMENTS = 8
"""InternVL's frames of a video where the job sets no video_segments: ms-swift's VIDEO_SEGMENTS default."""


VIDEO_MEMO = 1024
"""Videos whose plan a process keeps (a micro-batch's are looked up again at every step)."""


class VideoPlan(NamedTuple):
    """What the model reads of a video: its header, the frames sampled, their (width, height), the
    video's tokens and what would follow them were the video longer (a placeholder; InternVL's next
    `FrameN: <img>`): tokens that do belong to a video that changed since tokenizing."""
    header: VideoHeader
    indices: list[int]
    size: tuple[int, int]
    ids: list[int]
    follows: list[int]


class Videos:
    """A video-reading model's processors (transformers'; its video processor needs torchvision) with
    the job's bounds. Qwen's: frames sampled evenly at FPS, at most `fps_max_frames`, each scaled within
    `video_max_pixels`; InternVL's: `video_segments` frames, each squashed to one tile. A video's tokens
    are the processor's own layout of its frames: Qwen2-VL's and Qwen2.5-VL's one placeholder run,
    Qwen3-VL's a `<t seconds>` text and a bounded run per temporal patch, InternVL's a `FrameN: ` text
    and an image's run per frame."""

    def __init__(self, source: str, video_max_pixels: int | None = None, fps_max_frames: int | None = None,
                 video_segments: int | None = None):
        import inspect

        from transformers import AutoProcessor, AutoVideoProcessor

        self.tiled = model_config(source).model_type in TILED_FAMILIES
        """Each frame is one tile of an image (InternVL's), read as images are."""
        own = AutoVideoProcessor.from_pretrained(source)
        if self.tiled:
            # the processor's own sampling (the middle frame of each segment, as ms-swift's InternVL
            # reading), saved with the export so that it samples videos as training did
            bounds: dict = {"do_sample_frames": True, "num_frames": video_segments or VIDEO_SEGMENTS}
        else:
            self.merge = own.merge_size
            # the processor's own rule for a frame's size: frames are decoded at it (a long 4K video's
            # frames are not all held at full size) and not resized again
            self.smart_resize = importlib.import_module(type(own).__module__).smart_resize
            self.whole_video = "num_frames" in inspect.signature(self.smart_resize).parameters
            """Its size bounds a video's pixels over all its frames (Qwen3-VL's), not each frame's."""
            if self.whole_video:
                # transformers' port of qwen-vl-utils' per-frame cap (ms-swift reads Qwen3-VL's videos
                # through qwen-vl-utils); the job's video_max_pixels is that cap where set, else its own
                bounds = {"cap_pixels_per_frame": True}
                if video_max_pixels:
                    bounds["max_video_tokens"] = max(1, video_max_pixels // (own.patch_size * self.merge) ** 2)
            else:
                most = video_max_pixels or VIDEO_MAX_PIXELS
                bounds = {"size": {"shortest_edge": min(own.size["shortest_edge"], most), "longest_edge": most}}
            if fps_max_frames:
                bounds["max_frames"] = fps_max_frames
        self.processor = AutoVideoProcessor.from_pretrained(source, **bounds)
        self.layout = AutoProcessor.from_pretrained(source, video_processor=self.processor)
        """The model's processor, whose `replace_video_token` lays a video's frames out as text."""
        self._plans: dict[tuple[str, VideoHeader], VideoPlan] = {}
        """Each video's plan by its header (read once per version of the file): every micro-batch
        finds its videos' runs and decodes their frames by it."""

    def sampled(self, where: str, path: str, header: VideoHeader) -> list[int]:
        """The indices of the frames the model reads, as its processor samples them."""
        from transformers.video_utils import VideoMetadata

        least = 1 if self.tiled else self.processor.temporal_patch_size
        if header.frames < least:
            raise DataError(f"{where}: video {path} has {header.frames} frame(s); the model reads videos of at least "
                            f"{least} (one temporal patch)")
        metadata = VideoMetadata(total_num_frames=header.frames, fps=header.fps, width=header.width,
                                 height=header.height, duration=header.frames / header.fps)
        if self.tiled:  # a video shorter than its segments: each of its frames
            return self.processor.sample_frames(metadata, num_frames=min(self.processor.num_frames, header.frames)).tolist()
        return self.processor.sample_frames(metadata, fps=FPS).tolist()

    def frame_size(self, where: str, path: str, frames: int, header: VideoHeader) -> tuple[int, int]:
        """(height, width) the processor sizes the video's `frames` sampled frames to (its own
        `get_num_of_video_patches`' rule; InternVL's: its size, one tile, whatever the aspect)."""
        processor = self.processor
        if self.tiled:
            return processor.size["height"], processor.size["width"]
        factor = processor.patch_size * self.merge
        least, most = processor.size["shortest_edge"], processor.size["longest_edge"]
        try:
            if not self.whole_video:
                return self.smart_resize(header.height, header.width, factor=factor, min_pixels=least, max_pixels=most)
            if processor.cap_pixels_per_frame:
                per_frame = max(min(processor.max_video_tokens * factor ** 2, most // frames), int(least * 1.05))
                most = per_frame * frames
            return self.smart_resize(frames, header.height, header.width, temporal_factor=processor.temporal_patch_size,
                                     factor=factor, min_pixels=least, max_pixels=most)
        except ValueError as exc:  # the processor's own limits (an aspect ratio over 200)
            raise DataError(f"{where}: video {path}: {exc}") from None

    def plan(self, where: str, path: str) -> VideoPlan:
        """What the model reads of the video at `path` (its header read, not its frames): its sampled
        frames, their size and its tokens as the model's processor lays them out."""
        from transformers.video_utils import VideoMetadata

        header = video_header(where, path)
        key = (path, header)
        if key not in self._plans:
            indices = self.sampled(where, path, header)
            height, width = self.frame_size(where, path, len(indices), header)
            tokenize = self.layout.tokenizer
            if self.tiled:  # its layout reads the frame count off the pixels' first dimension alone
                inputs = {"pixel_values_videos": [torch.empty(len(indices), 0)]}
                ids = tokenize(self.layout.replace_video_token(inputs, 0), add_special_tokens=False)["input_ids"]
                longer = self.layout.replace_video_token({"pixel_values_videos": [torch.empty(len(indices) + 1, 0)]}, 0)
                longer = tokenize(longer, add_special_tokens=False)["input_ids"]
                follows = longer[len(ids):longer.index(self.layout.image_token_id, len(ids)) + 1]
            else:
                patch, temporal = self.processor.patch_size, self.processor.temporal_patch_size
                metadata = VideoMetadata(total_num_frames=header.frames, fps=header.fps, width=header.width,
                                         height=header.height, duration=header.frames / header.fps,
                                         frames_indices=indices)
                inputs = {"video_grid_thw": torch.tensor([[-(-len(indices) // temporal), height // patch, width // patch]]),
                          "video_metadata": [metadata]}
                ids = tokenize(self.layout.replace_video_token(inputs, 0), add_special_tokens=False)["input_ids"]
                follows = [self.layout.video_token_id]
            if len(self._plans) >= VIDEO_MEMO:
                self._plans.clear()
            self._plans[key] = VideoPlan(header, indices, (width, height), ids, follows)
        return self._plans[key]

    def ids(self, where: str, path: str) -> list[int]:
        """The tokens of the video at `path`, as the model's processor lays them out."""
        return self.plan(where, path).ids

    def pixels(self, videos: list[tuple[str, int]], where: str) -> dict[str, torch.Tensor]:
        """The processor's inputs for a micro-batch's videos, each (path, its placeholder tokens), and
        each video's seconds per temporal patch (Qwen2.5-VL's rope spaces them by it); a video twice in
        the micro-batch (a preference pair's two rows) decoded once. InternVL: the videos' frames as
        `pixel_values`, one tile each, in order."""
        clips, seconds, decoded = [], [], {}
        for path, _ in videos:
            plan = self.plan(where, path)
            if path not in decoded:
                decoded[path] = decode_video(where, path, plan.indices, plan.size)
            clips.append(decoded[path])
            if not self.tiled:
                seconds.append(self.processor.temporal_patch_size * plan.header.frames
                               / (len(plan.indices) * plan.header.fps))
        if self.tiled:
            # one call a video: its processor stacks a batch's videos, which needs equal frame counts
            frames = [self.processor(videos=[clip], do_sample_frames=False, do_resize=False,
                                     return_tensors="pt")["pixel_values_videos"][0] for clip in clips]
            counts = [len(f) * self.layout.image_seq_length for f in frames]
        else:
            # the per-frame cap's flag passed as set (a processor warns where it is not)
            out = self.processor(videos=clips, do_sample_frames=False, do_resize=False,
                                 cap_pixels_per_frame=bool(self.processor.cap_pixels_per_frame), return_tensors="pt")
            counts = [t * h * w // self.merge ** 2 for t, h, w in out["video_grid_thw"].tolist()]
        for (path, tokens), count in zip(videos, counts):
            if count != tokens:
                raise DataError(f"{where}: video {path} is not the size it had when the data was tokenized; "
                                "tokenize again (a new dataset_cache_dir, or remove the cache entry)")
        if self.tiled:
            return {"pixel_values": torch.cat(frames)}
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"],
                "second_per_grid_ts": torch.tensor(seconds)}


TILE_BOUNDS = ("<img>", "</img>")
FRAME_TEXT = "Frame{}: "
"""What InternVL's processor writes before a video frame's `<img>` (its `replace_video_token`)."""
NO_MEDIA, IMAGES, VIDEOS = 0, 1, 2
"""A row's media (`Images.media_kinds`); a row with both is IMAGES + VIDEOS."""
MEDIA_SCAN_ROWS = 65536
"""Rows whose token ids `Images.media_kinds` holds at once."""


class Images:
    """The model's image processor (`max_pixels` caps an image's size) and image placeholder token."""

    def __init__(self, model_dir: str, config, max_pixels: int | None = None, video_max_pixels: int | None = None,
                 fps_max_frames: int | None = None, video_segments: int | None = None):
        if config.model_type not in VISION_FAMILIES:
            raise UserError(f"model: {config.model_type} is not a vision-language family the worker trains yet "
                            f"(it does {', '.join(VISION_FAMILIES)})")
        self.processor = image_processor(model_dir, config, max_pixels)
        self.token_id = config.image_token_id
        self.merge = getattr(self.processor, "merge_size", 1)
        self.tiled = config.model_type in TILED_FAMILIES
        self.bounds: tuple[int, ...] = ()
        """The tokens around an image's run that the processor adds (InternVL's `<img>`, `</img>`)."""
        self.video_token_id = config.video_token_id if config.model_type in VIDEO_FAMILIES else None
        """The video placeholder token of a model that reads videos, else None."""
        self.frame_prefix: list[int] = []
        """InternVL: the tokens before a video's first frame's run (its processor's `Frame1: <img>`), by
        which a video's runs are told from an image's (both are image runs)."""
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
            # its config names no video token; its tokenizer's (an InternVL -hf checkpoint's `<video>`)
            self.video_token_id = getattr(tokenizer, "video_token_id", None)
            self.frame_prefix = tokenizer(f"{FRAME_TEXT.format(1)}{TILE_BOUNDS[0]}", add_special_tokens=False)["input_ids"]
        self.video_bounds = (model_dir, video_max_pixels, fps_max_frames, video_segments)
        self._videos: Videos | ReaderMissing | None = None
        self.ids = {self.token_id, *self.bounds} | ({self.video_token_id} if self.video_token_id is not None else set())
        """Every token an image's or a video's run takes."""
        self.rope_index = None
        """The model's multimodal rope (Qwen's and GLM-4V's `get_rope_index`; `bind`): packed rows' positions."""
        self.timed = False
        """Its rope spaces a video's temporal patches by their seconds (Qwen2.5-VL's `second_per_grid_ts`)."""

    @classmethod
    def of(cls, model_dir: str, config, spec) -> "Images":
        """The model's image side with the job's bounds of images and videos."""
        return cls(model_dir, config, spec.max_pixels, spec.video_max_pixels, spec.fps_max_frames, spec.video_segments)

    def persona(self, spec) -> Persona:
        """The job's `Persona` for this model: its records' images read, their videos where it reads them."""
        return Persona.of(spec, True, self.tiled, self.video_token_id is not None)

    def videos(self, where: str, path: str) -> Videos:
        """The video processor, built at the first video; where it cannot be (no torchvision), every
        video stops the run (never a record skipped: strict off) naming the first that needed it."""
        if self._videos is None:
            try:
                videos = Videos(*self.video_bounds)
            except (ImportError, RuntimeError, OSError, ValueError) as exc:
                videos = ReaderMissing(f"{where}: video {path}: the model's processor cannot be built here "
                                       f"({exc}; transformers' video processors need torchvision matching torch)")
            if self.tiled and isinstance(videos, Videos) and videos.layout.image_seq_length != self.per_tile:
                raise UserError(f"model: {self.video_bounds[0]}'s processor_config.json lays a video frame out as "
                                f"{videos.layout.image_seq_length} tokens; its config gives a tile {self.per_tile}")
            self._videos = videos
        if isinstance(self._videos, ReaderMissing):
            raise self._videos
        return self._videos

    def bind(self, model) -> None:
        """Takes the model's own multimodal rope, by which packed rows place each sample's image tokens
        (InternVL places them as text and has none)."""
        if not self.tiled:
            import inspect

            self.rope_index = next(module.get_rope_index for module in model.modules()
                                   if callable(getattr(type(module), "get_rope_index", None)))
            self.timed = "second_per_grid_ts" in inspect.signature(self.rope_index).parameters

    def placeholder(self, count: int) -> list[int]:
        """An image's tokens for `count` visual tokens."""
        run = [self.token_id] * count
        return [self.bounds[0], *run, self.bounds[1]] if self.bounds else run

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model takes beside the pixels: Qwen's and GLM-4V's token types (1 an image's, 2 a
        video's), from which transformers 5.24 computes their multimodal rope (InternVL places image
        tokens as text)."""
        if self.tiled:
            return {}
        types = (input_ids == self.token_id).int()
        if self.video_token_id is not None:
            types += 2 * (input_ids == self.video_token_id).int()
        return {"mm_token_type_ids": types}

    def packed_positions(self, input_ids: torch.Tensor, text_positions: torch.Tensor,
                         pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """Positions of packed rows (samples end to end, `text_positions` restarting at 0 with each) as
        transformers' Qwen-VL and GLM-4V language models take them, (4, rows, width): the text positions,
        from which the block-diagonal mask is built, over each sample's multimodal rope computed by the
        model on that sample alone (a padding tail is a sample of text). `pixels`: the rows' `pixels`
        (their images' and videos' grids, in order)."""
        segments = [(row, int(start), int(end))
                    for row, positions in enumerate(text_positions)
                    for start, end in zip(*_runs_from_zeros(positions))]
        longest = max(end - start for _, start, end in segments)
        ids = torch.zeros(len(segments), longest, dtype=input_ids.dtype)
        mask = torch.zeros(len(segments), longest, dtype=torch.long)
        for i, (row, start, end) in enumerate(segments):
            ids[i, :end - start], mask[i, :end - start] = input_ids[row, start:end], 1
        timed = {"second_per_grid_ts": pixels.get("second_per_grid_ts")} if self.timed else {}
        rope, _ = self.rope_index(ids, mm_token_type_ids=self.inputs(ids)["mm_token_type_ids"] * mask,
                                  image_grid_thw=pixels.get("image_grid_thw"),
                                  video_grid_thw=pixels.get("video_grid_thw"), attention_mask=mask, **timed)
        out = torch.zeros(3, *input_ids.shape, dtype=rope.dtype)
        for i, (row, start, end) in enumerate(segments):
            out[:, row, start:end] = rope[:, i, :end - start]
        return torch.cat([text_positions[None].to(out.dtype), out])

    def digest(self) -> str:
        """What the visual token counts depend on (the tokenized cache's key): the image processor, and
        a video's bounds and the model's own video processor file where it has one."""
        own = Path(self.video_bounds[0]) / "video_preprocessor_config.json"
        settings = [self.processor.to_dict(), self.video_bounds[1:], FPS, VIDEO_MAX_PIXELS, VIDEO_SEGMENTS,
                    own.read_text() if own.is_file() else None]
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()

    def run(self, where: str, token: int, path: str) -> list[int]:
        """The tokens of the image or video (by its placeholder `token`) at `path`."""
        if token == self.video_token_id:
            return self.videos(where, path).ids(where, path)
        return self.placeholder(self.tokens(where, path))

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

    def pixels(self, media: list[tuple[int, str, int]], where: str = "training data") -> dict[str, torch.Tensor]:
        """The processors' inputs for a micro-batch's images and videos, each (its placeholder token,
        path, its placeholder tokens, `media`'s): a count the processor does not give (an image that
        changed since tokenizing) is an error that names it."""
        if self.tiled and any(token == self.video_token_id for token, _, _ in media):
            # one `pixel_values`: each image's tiles and each video's frames in their order
            parts = [self.videos(where, path).pixels([(path, count)], where) if token == self.video_token_id
                     else self.image_pixels([(path, count)], where) for token, path, count in media]
            return {"pixel_values": torch.cat([part["pixel_values"] for part in parts])}
        videos = [(path, count) for token, path, count in media if token == self.video_token_id]
        images = [(path, count) for token, path, count in media if token != self.video_token_id]
        out = self.image_pixels(images, where) if images else {}
        if videos:
            out.update(self.videos(where, videos[0][0]).pixels(videos, where))
            if not self.timed:
                del out["second_per_grid_ts"]
        return out

    def decode_videos(self, where: str, ids: list[int], paths: list[str]) -> None:
        """Decode the frames training reads of a sample's videos (`ids`, `paths`: a `Sample`'s): an
        error names one that fails."""
        for token, path, _ in self.media(where, ids, paths):
            if token == self.video_token_id:
                decode_video(where, path, self.videos(where, path).plan(where, path).indices)

    def image_pixels(self, images: list[tuple[str, int]], where: str) -> dict[str, torch.Tensor]:
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

    def media_kinds(self, table, rows: np.ndarray) -> np.ndarray:
        """The media of a tokenized `table`'s (pyarrow) `rows`, in their order: NO_MEDIA, IMAGES,
        VIDEOS or both (the sum). A model that reads no videos: from the length of its `images` list;
        else from the placeholder tokens of those rows alone (a rank reads its share of the
        memory-mapped column, not all of it), MEDIA_SCAN_ROWS at a time."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.video_token_id is None or self.tiled:  # InternVL's frames go through the tower as images do
            lengths = pc.list_value_length(table.column("images")).to_numpy(zero_copy_only=False)
            return np.where(lengths[rows] > 0, IMAGES, NO_MEDIA).astype(np.int8)
        column, out = table.column("input_ids"), [np.zeros(0, dtype=np.int8)]
        for start in range(0, len(rows), MEDIA_SCAN_ROWS):
            chunk = column.take(pa.array(rows[start:start + MEDIA_SCAN_ROWS], type=pa.int64())).combine_chunks()
            flat = chunk.flatten().to_numpy(zero_copy_only=False)
            parents = pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False)
            kinds = np.zeros(len(chunk), dtype=np.int8)
            for token, kind in ((self.token_id, IMAGES), (self.video_token_id, VIDEOS)):
                kinds[np.unique(parents[flat == token])] |= kind
            out.append(kinds)
        return np.concatenate(out)

    def media(self, where: str, ids: list[int], paths: list[str]) -> list[tuple[int, str, int]]:
        """Each image and video of a sample (`ids`, and `paths` in the order of their tags), in order:
        (its placeholder token, path, the placeholder tokens it takes in `ids`). A video's run in `ids`
        must be its layout as the file gives it now (`Videos.ids`, over several runs where its processor
        puts text between its temporal patches or frames): a video that changed since tokenizing is
        named here. InternVL's videos are image runs, told by the `Frame1: <img>` before the first. An
        image's count is checked against its pixels (`pixels`)."""
        out, at = [], 0
        for path in paths:
            at = next((i for i in range(at, len(ids)) if ids[i] in (self.token_id, self.video_token_id)), None)
            if at is None:
                raise DataError(f"{where}: {len(paths)} image(s) and video(s) ({', '.join(paths)}), and fewer runs of "
                                f"their placeholder tokens in its {len(ids)} tokens")
            token = ids[at]
            video = token == self.video_token_id or (
                self.tiled and self.video_token_id is not None
                and ids[max(0, at - len(self.frame_prefix)):at] == self.frame_prefix)
            if video:
                plan = self.videos(where, path).plan(where, path)
                start = at - plan.ids.index(token)
                # the text after its last run may be cut off by max_length; what its layout would go on
                # with had the video more frames may not follow it
                end = min(start + len(plan.ids), len(ids))
                if (start < 0 or ids[start:end] != plan.ids[:end - start]
                        or (end < len(ids) and ids[end:end + len(plan.follows)] == plan.follows)):
                    raise DataError(f"{where}: video {path} is not the size it had when the data was tokenized; "
                                    "tokenize again (a new dataset_cache_dir, or remove the cache entry)")
                out.append((self.video_token_id, path, ids[start:end].count(token)))
                at = end
                continue
            end = at
            while end < len(ids) and ids[end] == token:
                end += 1
            out.append((token, path, end - at))
            at = end
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
