"""What training would make of a job's data, before launch: the first records of each dataset
through the model's chat template with the tokens that carry loss marked, the token lengths against
max_length (how many are truncated, how many dropped), the fill that packing would reach, and the
record counts. Tokenized exactly as the worker does (`launcher.data.encode`, the job's `columns`,
system prompt and names).

Run by the studio as `python -m launcher.preview` with the job as YAML on stdin; prints one JSON
object: {"max_length", "packing", "datasets": [{"entry", "count", "measured", "truncated",
"dropped", "lengths", "samples": [{"where", "tokens", "segments": [[text, carries_loss], ...]}],
"error"}], "packed_fill", "row_fill"} or {"error"} when the job or its tokenizer cannot be read.
"""
from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np

from backend.job.records import (DataError, Persona, decode_streamed, parse_source, positioned_records,
                                 selected_count, streamed_entries)
from backend.job.spec import parse_spec
from launcher.data import Pair, IGNORE, Sample, encode, pack_plan

SHOWN = 3  # records shown per dataset
MEASURED = 1000  # records per dataset whose token lengths are measured (the first ones)
UNCUT = 1 << 30  # a max_length no record reaches: the length before truncation


def segments(tokenizer, sample: Sample, media_tokens: tuple[int, ...] = ()) -> list[tuple[str, bool]]:
    """The sample's text in runs of tokens that carry loss (True) or do not; an image's or a video's
    run of placeholder tokens (`media_tokens`) shown once with its count."""
    runs, start = [], 0
    trained = [label != IGNORE for label in sample.labels]
    placeholders = [tokenizer.convert_ids_to_tokens(token) for token in media_tokens]
    for end in range(1, len(sample.input_ids) + 1):
        if end == len(sample.input_ids) or trained[end] != trained[start]:
            text = tokenizer.decode(sample.input_ids[start:end])
            for placeholder in placeholders:
                text = re.sub(f"(?:{re.escape(placeholder)})+",
                              lambda m: f"{placeholder}×{len(m.group()) // len(placeholder)}", text)
            runs.append((text, trained[start]))
            start = end
    return runs


THUMBNAIL_PX = 96


def thumbnail(path: str, video: bool = False) -> str:
    """A small PNG of the image (a video: its first frame) as a data: URI (made here, so the page
    shows no file of the user's as such)."""
    import base64
    import io

    from PIL import Image

    from backend.job.records import decode_video, open_image

    with (Image.fromarray(decode_video("preview", path, [0])[0]) if video else open_image("preview", path)) as image:
        image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        out = io.BytesIO()
        image.convert("RGB").save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def dataset_preview(entry: str, spec, tokenizer, persona: Persona, images=None) -> dict:
    """`images`: a vision-language model's `launcher.vision.Images` (its records' images counted and shown)."""
    source = parse_source(entry)
    out = {"entry": entry, "count": None, "measured": 0, "truncated": 0, "dropped": 0, "lengths": [],
           "samples": [], "error": None}
    media_tokens = tuple(sorted(images.ids - set(images.bounds))) if images is not None else ()
    video_token = images.video_token_id if images is not None else None
    try:
        if spec.streaming and source.is_local:  # what training reads first, and no count of a file of any size
            base = str(Path(source.name).parent)
            records = (decode_streamed(where, raw, base) for where, raw in streamed_entries(source, spec.max_record_bytes))
        else:
            out["count"] = selected_count(source, spec.max_record_bytes, spec.seed)
            records = (record for _, record in positioned_records(source, 0, 1, spec.seed, spec.max_record_bytes))
        for record in itertools.islice(records, MEASURED):
            whole = encode(record, tokenizer, UNCUT, persona, images)
            if isinstance(whole, Pair):  # a preference pair: shown and measured by its chosen answer
                whole = whole.chosen
            out["measured"] += 1
            length = len(whole.input_ids) if whole else 0
            out["lengths"].append(length)
            out["truncated"] += length > spec.max_length
            # what the worker keeps: a sample with a token to learn from within max_length
            if whole is None or not any(label != IGNORE for label in whole.labels[1:spec.max_length]):
                out["dropped"] += 1
            elif len(out["samples"]) < SHOWN:
                cut = Sample(whole.input_ids[:spec.max_length], whole.labels[:spec.max_length])
                out["samples"].append({"where": record.where, "tokens": len(cut.input_ids),
                                       "segments": segments(tokenizer, cut, media_tokens),
                                       "images": [thumbnail(path, token == video_token) for token, path, _ in
                                                  images.media(record.where, whole.input_ids, whole.images)]
                                       if images is not None else []})
    except DataError as exc:
        out["error"] = str(exc)
    return out


def preview(spec, tokenizer, images=None) -> dict:
    persona = images.persona(spec) if images is not None else Persona.of(spec)
    datasets = [dataset_preview(entry, spec, tokenizer, persona, images) for entry in spec.dataset]
    kept = np.array([min(n, spec.max_length) for d in datasets for n in d["lengths"] if n > 1], dtype=np.int64)
    packed_fill = row_fill = None
    if len(kept):
        row_fill = float(kept.mean() / spec.max_length)
        packed_fill = float(kept.sum() / (len(pack_plan(kept, spec.max_length)) * spec.max_length))
    return {"max_length": spec.max_length, "packing": spec.packing, "padding_free": spec.padding_free, "datasets": datasets,
            "packed_fill": packed_fill, "row_fill": row_fill}


def main() -> int:
    import yaml

    from backend.job.errors import UserError
    from launcher.model import ModelError, load_tokenizer
    from launcher.vision import Images, model_config

    try:
        spec, problems = parse_spec(yaml.safe_load(sys.stdin.read()) or {})
        if spec is None:
            raise ValueError("; ".join(str(p) for p in problems))
        config = model_config(spec.model)
        images = Images.of(spec.model, config, spec) if config is not None else None
        result = preview(spec, load_tokenizer(spec.model), images)
    except (ValueError, ModelError, UserError, yaml.YAMLError) as exc:
        result = {"error": str(exc)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
