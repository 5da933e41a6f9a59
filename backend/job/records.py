"""Dataset records: where they come from, how they are read, which formats they may have.

Shared by the worker (which tokenizes them) and the validator (which checks a sample of each local
file before launch), so both read a file the same way. Stdlib only at module level: the studio
imports it on every form change.

Public API:
    parse_source(entry) -> Source         'data.jsonl', 'org/name', 'org/name#500'
    read_records(source, rank, world, seed, max_record_bytes) -> Iterator[Record]
    positioned_records(...)                the same with each record's position in its source's selection
    to_messages(record, persona) / pretokenized(record)   the record's content, or DataError naming it
    Persona.of(spec)                       the job's column renames, system prompt and {{NAME}}/{{AUTHOR}} fill-ins
    check_record(record, persona)          raises DataError where the worker would
"""
from __future__ import annotations

import bisect
import codecs
import csv
import functools
import json
import os
import random
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

from backend.job.errors import UserError
from backend.job.jsonfile import read_json
from backend.job.modelcfg import VIDEO_FAMILIES
from backend.job.paths import not_a_regular_file

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(UserError):
    """A user-fixable problem with the data; the message names the file and line (or record)."""


@dataclass(frozen=True)
class Source:
    """One `dataset` entry: a local file or a hub id, optionally limited to `limit` samples."""

    name: str
    limit: int | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.name).suffix.lower() in LOCAL_SUFFIXES or Path(self.name).exists()


def parse_source(entry: str) -> Source:
    """'data.jsonl', 'org/name', 'org/name#500' (first 500 after a seeded shuffle, as ms-swift)."""
    name, sep, count = entry.rpartition("#")
    if not sep:
        return Source(entry)
    if not count.isdigit() or int(count) < 1:
        raise DataError(f"dataset '{entry}': the part after '#' must be a positive sample count")
    return Source(name, int(count))


@dataclass(frozen=True)
class Record:
    where: str  # "file:line" or "hub-id[index]", for messages
    data: Any
    base: str = ""
    """The directory of the file it came from, where its relative image paths lead ("" for a hub record)."""


def read_records(source: Source, rank: int, world: int, seed: int, max_record_bytes: int) -> Iterator[Record]:
    """This rank's records of one source. JSON-lines and CSV files are streamed (twice: once to
    count) and only this rank's JSON lines are parsed; JSON and parquet files are read whole. A
    JSON line longer than `max_record_bytes` raises DataError naming it, never read whole."""
    return (record for _, record in positioned_records(source, rank, world, seed, max_record_bytes))


def positioned_records(source: Source, rank: int, world: int, seed: int,
                       max_record_bytes: int) -> Iterator[tuple[int, Record]]:
    """`read_records` with each record's position in the source's selection: the records of
    `rank` are those whose position % world == rank, in position order."""
    if not source.is_local:
        yield from _hub_records(source, rank, world, seed)
        return
    entries, decode = _entries(source, max_record_bytes)
    position_of = _selected(len(entries), source.limit, seed)
    for index, (where, raw) in enumerate(entries):
        position = position_of(index)
        if position is not None and position % world == rank:
            yield position, Record(where, decode(where, raw), str(Path(source.name).parent))


def _entries(source: Source, max_record_bytes: int) -> tuple["Entries", "Decode"]:
    """A local source's records, counted or read, by its file type."""
    path = Path(source.name)
    problem = not_a_regular_file(path)
    if problem:
        raise DataError(f"dataset file {path} {problem}")
    reader = {".json": _json, ".csv": _csv, ".parquet": _parquet}.get(path.suffix.lower())
    return reader(path) if reader else _jsonl(path, max_record_bytes)


def selected_count(source: Source, max_record_bytes: int, seed: int) -> int:
    """How many records of `source` a run reads: its records, or `name#N`'s N of them."""
    if not source.is_local:
        return len(hub_dataset(source, seed))
    total = len(_entries(source, max_record_bytes)[0])
    return total if source.limit is None else min(total, source.limit)


def _selected(total: int, limit: int | None, seed: int) -> Callable[[int], int | None]:
    """Record index → its position in the selection (positions decide the rank), None where not
    selected. Memory holds the selection only when there is a limit, and then as 8 bytes per
    selected record: a file of ten million records is never listed."""
    if limit is None or limit >= total:
        return lambda index: index
    chosen = array("q", sorted(random.Random(seed).sample(range(total), limit)))

    def position(index: int) -> int | None:
        at = bisect.bisect_left(chosen, index)
        return at if at < len(chosen) and chosen[at] == index else None
    return position


class Entries(Protocol):
    """(where, raw record) pairs that can be counted, then read."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[str, Any]]: ...


Decode = Callable[[str, Any], Any]


class _FileRows:
    """A file's records as (where, raw), read from disk on each pass (the file may not fit in
    memory); `rows` splits the open file (binary or text) into them."""

    def __init__(self, path: Path, rows: Callable[[Path, Any], Iterator[tuple[str, Any]]], binary: bool = False):
        self.path, self.rows, self.binary = path, rows, binary

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        with (open(self.path, "rb") if self.binary else open(self.path, encoding="utf-8", newline="")) as f:
            yield from self.rows(self.path, f)


def _bounded_lines(f, limit: int) -> Iterator[bytes | None]:
    """The binary file's lines; None for a line longer than `limit` bytes, which is skipped a
    chunk at a time, never held whole."""
    while raw := f.readline(limit + 1):
        if len(raw) > limit and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield raw


def _too_long(where: str, limit: int) -> DataError:
    return DataError(f"{where}: a record of more than {limit / 2**20:g} MiB; raise max_record_mib if it is "
                     "meant to be one record (a record is read and tokenized whole)")


def _jsonl_rows(path: Path, f, limit: int) -> Iterator[tuple[str, bytes]]:
    for lineno, raw in enumerate(_bounded_lines(f, limit), 1):
        if raw is None:
            raise _too_long(f"{path}:{lineno}", limit)
        if raw.strip():
            yield f"{path}:{lineno}", raw


def _csv_rows(path: Path, f) -> Iterator[tuple[str, dict]]:
    reader = csv.DictReader(f)
    for row in reader:
        yield f"{path}:{reader.line_num}", row


def _json_line(where: str, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _as_read(where: str, record: Any) -> Any:
    return record


def _jsonl(path: Path, limit: int) -> tuple[Entries, Decode]:
    return _FileRows(path, functools.partial(_jsonl_rows, limit=limit), binary=True), _decoded_line


def _json(path: Path) -> tuple[Entries, Decode]:
    data = read_json(path, "dataset", DataError)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return [(f"{path}: record {index + 1}", item) for index, item in enumerate(data)], _as_read


def _csv(path: Path) -> tuple[Entries, Decode]:
    return _FileRows(path, _csv_rows), _as_read


def _parquet(path: Path) -> tuple[Entries, Decode]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet ({exc})") from None
    return [(f"{path}: row {index + 1}", row) for index, row in enumerate(table.to_pylist())], _as_read


def streamed_entries(source: Source, max_record_bytes: int) -> Iterator[tuple[str, bytes]]:
    """A local source's records as (where, JSON bytes), read as they come, never listed: a JSON
    line as it is in the file (decoded by `decode_streamed` where a rank keeps it), a CSV or parquet
    row as JSON (parquet a record batch at a time). A JSON file is one list, read whole."""
    path = Path(source.name)
    problem = not_a_regular_file(path)
    if problem:
        raise DataError(f"dataset file {path} {problem}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_stream(path)
        return
    if suffix not in (".json", ".csv"):
        with open(path, "rb") as f:
            yield from _jsonl_rows(path, f, max_record_bytes)
        return
    entries, _ = _entries(source, max_record_bytes)
    for where, record in entries:
        yield where, _json_bytes(where, record)


def decode_streamed(where: str, raw: bytes, base: str = "") -> Record:
    """`base`: the directory of the file it came from (its relative image paths lead there)."""
    return Record(where, _decoded_line(where, raw), base)


def _json_bytes(where: str, record: Any) -> bytes:
    try:
        return json.dumps(record, ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: a value that is not JSON text, numbers, lists or mappings ({exc})") from None


def _parquet_stream(path: Path) -> Iterator[tuple[str, bytes]]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        row = 0
        for batch in reader.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", _json_bytes(f"{path}: row {row}", record)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet ({exc})") from None


def hub_dataset(source: Source, seed: int):
    """A hub source as `datasets` loads it (its local cache when there), limited to `source.limit`
    samples after a seeded shuffle."""
    import datasets

    try:
        ds = datasets.load_dataset(source.name, split="train")
    except Exception as exc:  # network, missing dataset, auth: all user-facing
        raise DataError(f"dataset '{source.name}': cannot load from the hub ({exc})") from None
    for name, feature in ds.features.items():  # images as their stored bytes and path, not decoded by datasets
        undecoded = _undecoded(feature)
        if undecoded != feature:
            ds = ds.cast_column(name, undecoded)
    if source.limit is not None and source.limit < len(ds):
        ds = ds.shuffle(seed=seed).select(range(source.limit))
    return ds


def _undecoded(feature):
    """A datasets feature with its Image parts (at any depth of lists and mappings) not decoded."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, datasets.List):
        return datasets.List(_undecoded(feature.feature), length=feature.length)
    if isinstance(feature, datasets.LargeList):
        return datasets.LargeList(_undecoded(feature.feature))
    if isinstance(feature, dict):
        return {key: _undecoded(value) for key, value in feature.items()}
    return feature


def _hub_records(source: Source, rank: int, world: int, seed: int) -> Iterator[tuple[int, Record]]:
    ds = hub_dataset(source, seed)
    for index in range(rank, len(ds), world):
        yield index, Record(f"{source.name}[{index}]", ds[index])


# ---- formats -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Persona:
    """What the job does to every record, as ms-swift's --columns, --system, --model_name and
    --model_author do."""

    system: str | None = None
    name: tuple[str, ...] = ()
    author: tuple[str, ...] = ()
    columns: tuple[tuple[str, str], ...] = ()
    pairs: bool = False
    """Every record is a preference pair (`rlhf_type`): a prompt with a chosen and a rejected answer."""
    images: bool = False
    """The model reads images (a vision-language model): a record's `images` go where its `<image>` tags are."""
    tiled: bool = False
    """Its image processor cuts images into tiles of a fixed size (InternVL's), whatever their aspect ratio."""
    videos: bool = False
    """It reads videos too (`backend.job.modelcfg.VIDEO_FAMILIES`): a record's `videos` go where its
    `<video>` tags are."""

    @classmethod
    def of(cls, spec, images: bool = False, tiled: bool = False, videos: bool = False) -> "Persona":
        return cls(spec.system, tuple(spec.model_name), tuple(spec.model_author), tuple(spec.columns.items()),
                   spec.rlhf_type is not None, images, tiled, images and videos)

    def renamed(self, record: Record) -> Record:
        """The record with the job's `columns` renamed, as every reader of it sees it (the worker,
        validation, the export's sample); a renamed column that the record already has is an error."""
        if not self.columns or not isinstance(record.data, dict):
            return record
        rename = dict(self.columns)
        data: dict[str, Any] = {}
        came_from: dict[str, str] = {}
        for key, value in record.data.items():
            new = rename.get(key, key)
            if new in data:
                raise DataError(f"{record.where}: columns makes both {came_from[new]!r} and {key!r} the column "
                                f"{new!r}; rename only one of them")
            data[new], came_from[new] = value, key
        return Record(record.where, data, record.base)

    def fill(self, where: str, text: str) -> str:
        """`text` with {{NAME}} and {{AUTHOR}} filled in: the first name for Chinese text and the
        second for other text when two are given (ms-swift's order), else the one. The language is
        the record's own, not that of a name filled in before."""
        chinese = bool(_CJK.search(text))
        for key, names, field in (("{{NAME}}", self.name, "model_name"), ("{{AUTHOR}}", self.author, "model_author")):
            if key in text:
                if not names:
                    raise DataError(f"{where}: the record says {key}; set {field} to the name it stands for")
                text = text.replace(key, names[0] if len(names) == 1 or chinese else names[1])
        return text

    def apply(self, where: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return with_system([{**m, "content": self.fill(where, m["content"])} for m in messages], self.system)


def with_system(messages: Sequence[dict[str, str]], system: str | None) -> list[dict[str, str]]:
    """`messages` with `system` first where they have no system message of their own (ms-swift's
    --system): training, the export's sample and the chat ask a model alike."""
    if system and not any(m["role"] == "system" for m in messages):
        return [{"role": "system", "content": system}, *messages]
    return list(messages)


_CJK = re.compile("[\u3400-\u9fff\uf900-\ufaff]")


def to_messages(record: Record, persona: Persona = Persona()) -> tuple[list[dict[str, str]] | None, str | None]:
    """(chat messages, None) for chat-like records or (None, text) for plain text records, with
    the job's `persona` filled in. `record` is as `persona.renamed` gives it."""
    messages, text = _content(record, persona.images, persona.videos)
    if messages is None:
        return None, persona.fill(record.where, text)
    return persona.apply(record.where, messages), None


def _content(record: Record, images: bool = False, videos: bool = False
             ) -> tuple[list[dict[str, str]] | None, str | None]:
    data = record.data
    if not isinstance(data, dict):
        raise DataError(f"{record.where}: expected an object with fields, got {type(data).__name__}")
    _text_only(record, images, videos)
    tags = media_tags(record) if images else {}
    if tags and (any(data.get(field) for field in tags) or any(
            tag in json.dumps(data.get("messages", data.get("conversations"))) for tag in tags.values())):
        text_only = {k: v for k, v in data.items() if k not in MEDIA_TAGS}
        messages, _ = _content(Record(record.where, text_only, record.base))
        if messages is None:
            raise DataError(f"{record.where}: {' and '.join(tags)} need a conversation ('messages') whose "
                            f"{' and '.join(tags.values())} tags say where they go")
        _one_tag_each(record, messages, "messages")
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        for i, m in enumerate(messages):
            for field, tag in tags.items():
                if tag in m["content"] and (m["role"] == "assistant" or i > last):
                    where = "in an assistant answer" if m["role"] == "assistant" else "after the last assistant answer"
                    raise DataError(f"{record.where}: an {tag} tag {where} (message {i + 1}): {field} go in the "
                                    "turns the answers are trained on")
        return messages, None
    if "messages" in data or "conversations" in data:
        return _chat(record, data.get("messages", data.get("conversations"))), None
    system = data.get("system")
    prefix = [{"role": "system", "content": str(system)}] if system else []
    if "instruction" in data and "output" in data:
        prompt = str(data["instruction"])
        if data.get("input"):
            prompt += "\n" + str(data["input"])
        return prefix + [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(data["output"])}], None
    if "query" in data and "response" in data:
        return prefix + [{"role": "user", "content": str(data["query"])},
                         {"role": "assistant", "content": str(data["response"])}], None
    if "text" in data:
        if not isinstance(data["text"], str) or not data["text"]:
            raise DataError(f"{record.where}: 'text' must be a non-empty string")
        return None, data["text"]
    raise DataError(f"{record.where}: unknown record format with fields {sorted(data)}; expected 'messages', "
                    "'instruction'+'output', 'query'+'response', 'text' or 'input_ids' (the job's columns field "
                    "renames a dataset's own, e.g. {\"question\": \"query\", \"answer\": \"response\"})")


MEDIA_FIELDS = ("images", "videos", "audios")
"""ms-swift's and LLaMA-Factory's media beside a record's text (`<image>` tags in it mark where)."""


IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
MEDIA_TAGS = {"images": IMAGE_TAG, "videos": VIDEO_TAG}
"""The media a vision-language model reads and the tag in a record's text that marks where each goes."""


def media_tags(record: Record) -> dict[str, str]:
    """The tags that mark media in this record's text: `<image>` always (a vision-language model
    reads images), `<video>` where the record has videos; elsewhere "<video>" is text (HTML, say)."""
    return MEDIA_TAGS if record.data.get("videos") else {"images": IMAGE_TAG}


def _text_only(record: Record, images: bool = False, videos: bool = False) -> None:
    """A record with media the model does not read is refused by name: its text alone would train
    the `<image>` tags as plain text, silently. `images`: the model reads images; `videos`: videos
    too (not yet audio)."""
    for field in MEDIA_FIELDS:
        if not record.data.get(field) or (field == "images" and images) or (field == "videos" and videos):
            continue
        why = ("the model is not a vision-language model" if not images else
               f"this model's videos are not read yet (images are; videos are with {', '.join(VIDEO_FAMILIES)})"
               if field == "videos" else f"{field} are not supported yet (images are)")
        raise DataError(f"{record.where}: a multimodal record ('{field}'): {why}, and its text alone would train "
                        "its <image>/<video> tags as plain text; give text-only records or a vision-language model")


def record_videos(record: Record) -> list[str]:
    """The record's `videos`: video file paths (ms-swift's and LLaMA-Factory's lists), each read
    from its file's directory when relative."""
    videos = record.data.get("videos")
    if not (isinstance(videos, list) and all(isinstance(v, str) and v.strip() for v in videos)):
        raise DataError(f"{record.where}: 'videos' must be a list of video file paths")
    return [os.path.join(record.base, os.path.expanduser(v)) if record.base else os.path.expanduser(v) for v in videos]


def record_media(record: Record, messages: list[dict[str, str]]) -> list[str]:
    """The record's images and videos in the order their tags come in `messages` (as the job shows
    them to the model: its system prompt and names filled in), which is the order of their
    placeholders in the rendered conversation."""
    tags = media_tags(record)
    queues = {IMAGE_TAG: iter(record_images(record) if record.data.get("images") else []),
              VIDEO_TAG: iter(record_videos(record) if record.data.get("videos") else [])}
    found = re.compile("|".join(map(re.escape, tags.values())))
    out = []
    for m in messages:
        for tag in found.findall(m["content"]):
            path = next(queues[tag], None)
            if path is None:
                raise DataError(f"{record.where}: more {tag} tags than {_MEDIA_OF[tag]} where the job shows it to the "
                                "model: its system prompt, model_name or model_author adds one")
            out.append(path)
    return out


_MEDIA_OF = {tag: field for field, tag in MEDIA_TAGS.items()}


def record_images(record: Record) -> list[str]:
    """The record's `images`, each a path read from its file's directory when relative (ms-swift's
    and LLaMA-Factory's lists of paths), an image inline as a `data:image/...;base64,` URI, or a
    `datasets` Image value as a parquet file or a hub dataset stores it ({"bytes", "path"}: its
    bytes, made an inline URI, else its path)."""
    images = record.data.get("images")
    if isinstance(images, dict):  # a single datasets Image column value
        images = [images]
    found = [_image_entry(image) for image in images] if isinstance(images, list) else [None]
    if None in found:
        raise DataError(f"{record.where}: 'images' must be a list of image file paths, data:image URIs or "
                        "{bytes, path} images (a datasets Image column)")
    return [i if i.startswith("data:") else
            os.path.join(record.base, os.path.expanduser(i)) if record.base else os.path.expanduser(i) for i in found]


# The first bytes of the formats PIL reads that images in datasets usually are.
_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"II*\0", "tiff"),
          (b"MM\0*", "tiff"))


def _image_entry(image: Any) -> str | None:
    """One entry of `images` as a path or data: URI; None for a value that is neither."""
    if isinstance(image, str):
        return image if image.strip() else None
    if not isinstance(image, dict) or not set(image) <= {"bytes", "path"}:
        return None
    data, path = image.get("bytes"), image.get("path")
    if isinstance(data, (bytes, bytearray)) and data:
        import base64

        kind = "webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else next(
            (name for magic, name in _MAGIC if data.startswith(magic)), "unknown")
        return f"data:image/{kind};base64," + base64.b64encode(data).decode()
    return path if isinstance(path, str) and path.strip() else None


def shown_image(image: str) -> str:
    """An image as a message names it: its path, or "inline" for a data: URI (not its bytes)."""
    return image if not image.startswith("data:") else "inline (data: URI)"


def open_image(where: str, image: str):
    """PIL's lazy image of a path or a `data:image/...;base64,` URI, its failures named by record."""
    import base64
    import binascii
    import io

    from PIL import Image

    shown = shown_image(image)
    try:
        if image.startswith("data:"):
            head, _, payload = image.partition(",")
            if not head.startswith("data:image/") or not head.endswith(";base64"):
                raise DataError(f"{where}: image {head[:40]!r}...: an inline image must be a data:image/...;base64, URI")
            return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        problem = not_a_regular_file(image)  # a FIFO would block the read
        if problem == "not found":
            raise FileNotFoundError(image)
        if problem:
            raise DataError(f"{where}: image {image} {problem}")
        return Image.open(image)
    except FileNotFoundError:
        raise DataError(f"{where}: image {shown} not found (a relative path is read from the data file's "
                        "directory)") from None
    except binascii.Error as exc:
        raise DataError(f"{where}: image {shown} is not base64 ({exc})") from None
    except Image.DecompressionBombError as exc:
        raise DataError(f"{where}: image {shown} is larger than PIL's decompression-bomb limit ({exc})") from None
    except (Image.UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{where}: image {shown} is not an image PIL can read ({exc})") from None


_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def _chat(record: Record, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{record.where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{record.where}: message {i + 1} must be an object with 'role' and 'content'")
        role = m.get("role", _SHAREGPT_ROLES.get(m.get("from", ""), None))
        content = m.get("content", m.get("value"))
        if isinstance(content, list):  # OpenAI's content parts: text, image_url, input_audio, ...
            kinds = sorted({str(part.get("type")) for part in content if isinstance(part, dict)})
            raise DataError(f"{record.where}: message {i + 1}'s content is a list of parts ({', '.join(kinds)}): "
                            "give its text as a string (multimodal content is not supported yet)")
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise DataError(f"{record.where}: message {i + 1} needs a 'role' (system/user/assistant/tool) "
                            f"and a string 'content'")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{record.where}: no assistant message, nothing to learn from")
    return out


PAIR_FORMATS = ("'messages' ending in the chosen answer with 'rejected_response' (ms-swift), 'chosen' and "
                "'rejected' answers after a 'prompt', 'instruction' or 'conversations' (TRL, LLaMA-Factory), or "
                "'chosen' and 'rejected' conversations that differ in their last answer")


def to_pair(record: Record, persona: Persona = Persona()) -> tuple[list[dict[str, str]], str, str]:
    """(prompt messages, chosen answer, rejected answer) of a preference record, with the job's
    `persona` filled in. `record` is as `persona.renamed` gives it."""
    data, where = record.data, record.where
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(data).__name__}")
    _text_only(record, persona.images, persona.videos)
    if "rejected_response" in data:
        conversation = _chat(record, data.get("messages", data.get("conversations")))
        if conversation[-1]["role"] != "assistant":
            raise DataError(f"{where}: 'messages' must end with the chosen assistant answer beside 'rejected_response'")
        prompt, chosen, rejected = conversation[:-1], conversation[-1]["content"], _answer(where, "rejected_response",
                                                                                           data["rejected_response"])
    elif "chosen" in data and "rejected" in data:
        chosen_turns = _turns(record, "chosen", data["chosen"])
        rejected_turns = _turns(record, "rejected", data["rejected"])
        prompt = _pair_prompt(record)
        if prompt is None:  # two whole conversations: the prompt is what they share before the last answer
            if len(chosen_turns) < 2 or chosen_turns[:-1] != rejected_turns[:-1]:
                raise DataError(f"{where}: without a prompt, 'chosen' and 'rejected' must be conversations that "
                                "differ only in their last answer")
            prompt, chosen_turns, rejected_turns = chosen_turns[:-1], chosen_turns[-1:], rejected_turns[-1:]
        if len(chosen_turns) != 1 or len(rejected_turns) != 1 or "assistant" != chosen_turns[0]["role"] \
                or rejected_turns[0]["role"] != "assistant":
            raise DataError(f"{where}: 'chosen' and 'rejected' must each be one assistant answer after the prompt")
        chosen, rejected = chosen_turns[0]["content"], rejected_turns[0]["content"]
    else:
        raise DataError(f"{where}: not a preference pair (fields {sorted(data)}); expected {PAIR_FORMATS}")
    if not prompt or prompt[-1]["role"] == "assistant":
        raise DataError(f"{where}: the prompt before the chosen and rejected answers must end with a user turn")
    if not rejected.strip():
        raise DataError(f"{where}: the rejected answer is empty")
    if chosen == rejected:
        raise DataError(f"{where}: the chosen and rejected answers are the same: the pair teaches nothing")
    if persona.images:
        _pair_media(record, prompt, chosen, rejected)
    return persona.apply(where, prompt), persona.fill(where, chosen), persona.fill(where, rejected)


def _pair_media(record: Record, prompt: list[dict[str, str]], chosen: str, rejected: str) -> None:
    """A pair's images and videos go in its prompt (both answers are about them), one tag each."""
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        for field, tag in media_tags(record).items():
            if tag in answer:
                raise DataError(f"{record.where}: an {tag} tag in the {name} answer: a pair's {field} go in its "
                                "prompt, which both answers follow")
    _one_tag_each(record, prompt, "prompt")


def _one_tag_each(record: Record, messages: list[dict[str, str]], named: str) -> None:
    read = {"images": record_images, "videos": record_videos}
    for field, tag in media_tags(record).items():
        count = len(read[field](record)) if record.data.get(field) is not None else 0
        tags = sum(m["content"].count(tag) for m in messages)
        if tags != count:
            raise DataError(f"{record.where}: {tags} {tag} tag(s) in its {named} and {count} {field[:-1]}(s): each "
                            f"{field[:-1]} needs a {tag} tag where it goes")


def _answer(where: str, field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: '{field}' must be a string")
    return value


def _turns(record: Record, field: str, value: Any) -> list[dict[str, str]]:
    """An answer given as text, as one message ({'role'/'from', 'content'/'value'}) or as a list of them."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    turns = [value] if isinstance(value, dict) else value
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{record.where}: '{field}' must be text, a message or a list of messages")
    out = []
    for i, m in enumerate(turns):
        role = m.get("role", _SHAREGPT_ROLES.get(m.get("from", ""))) if isinstance(m, dict) else None
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise DataError(f"{record.where}: '{field}' message {i + 1} needs a 'role' and a string 'content'")
        out.append({"role": role, "content": content})
    return out


def _pair_prompt(record: Record) -> list[dict[str, str]] | None:
    data = record.data
    system = data.get("system")
    prefix = [{"role": "system", "content": str(system)}] if system else []
    if "prompt" in data:
        prompt = data["prompt"]
        return prefix + ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                         else _turns(record, "prompt", prompt))
    if "conversations" in data or "messages" in data:
        return prefix + _turns(record, "conversations", data.get("conversations", data.get("messages")))
    if "instruction" in data:
        text = str(data["instruction"]) + ("\n" + str(data["input"]) if data.get("input") else "")
        return prefix + [{"role": "user", "content": text}]
    return None


def is_pretokenized(record: Record) -> bool:
    return isinstance(record.data, dict) and "input_ids" in record.data


def pretokenized(record: Record) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a record that already holds token ids (`labels` optional, -100 = no loss)."""
    ids, labels = record.data["input_ids"], record.data.get("labels", record.data["input_ids"])
    if not (isinstance(ids, list) and isinstance(labels, list) and len(ids) == len(labels) and ids
            and all(isinstance(t, int) for t in ids + labels)):
        raise DataError(f"{record.where}: 'input_ids' (and 'labels') must be equally long, non-empty lists of integers")
    return ids, labels


def check_record(record: Record, persona: Persona = Persona()) -> None:
    """Raise the DataError the worker would raise for this record (before tokenizing it)."""
    record = persona.renamed(record)
    if persona.pairs:
        to_pair(record, persona)
    elif is_pretokenized(record):
        pretokenized(record)
        return
    else:
        to_messages(record, persona)
    if persona.images and isinstance(record.data, dict) and record.data.get("images"):
        for path in record_images(record):
            verify_image(record.where, path, bounded=not persona.tiled)
    if persona.videos and isinstance(record.data, dict) and record.data.get("videos"):
        for path in record_videos(record):
            verify_video(record.where, path)


MAX_IMAGE_RATIO = 200
"""The longest side over the shortest that Qwen-VL's image processors take (their smart_resize)."""


def verify_image(where: str, path: str, bounded: bool = True) -> None:
    """Raise a DataError naming the record and the file if `path` (or an inline image) is not a
    whole image PIL decodes (missing, not a regular file, not an image, truncated, past PIL's
    decompression-bomb limit) or, `bounded` (the processor is not a tiling one), has a side over
    MAX_IMAGE_RATIO times the other."""
    shown = shown_image(path)
    with open_image(where, path) as image:
        try:
            image.load()  # decoded whole: verify() alone passes a truncated JPEG
        except Exception as exc:  # PIL raises several types for a damaged file
            raise DataError(f"{where}: image {shown} is not a whole image PIL can read ({type(exc).__name__}: "
                            f"{exc})") from None
        width, height = image.size
    if bounded and max(width, height) > MAX_IMAGE_RATIO * min(width, height):
        raise DataError(f"{where}: image {shown} is {width}x{height}: a side over {MAX_IMAGE_RATIO} times the other, "
                        "which the model's image processor refuses")


@dataclass(frozen=True)
class VideoHeader:
    """What a video file's header says: its frame count, rate and size."""
    frames: int
    fps: float
    width: int
    height: int


class ReaderMissing(DataError):
    """What reads a record's media is missing where it runs (PyAV, torchvision): not the record's
    fault, so never a record to skip (strict off) but a stop that names what to install."""


MIN_VIDEO_FRAMES = 2
"""The fewest frames a video may have: one temporal patch of the Qwen-VL families that read videos
(the worker checks their processor's own temporal patch)."""


def _pyav(where: str, path: str):
    try:
        import av
    except ImportError:
        raise ReaderMissing(f"{where}: video {path}: reading videos needs PyAV here (pip install av)") from None
    return av


def open_video(where: str, path: str):
    """PyAV's container of a video file with a video stream, its failures named by record."""
    problem = not_a_regular_file(path)  # a FIFO would block the read
    if problem == "not found":
        raise DataError(f"{where}: video {path} not found (a relative path is read from the data file's directory)")
    if problem:
        raise DataError(f"{where}: video {path} {problem}")
    av = _pyav(where, path)
    try:
        container = av.open(path, metadata_errors="replace")  # a crafted title is no reason to refuse it
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise DataError(f"{where}: video {path} is not a video PyAV can read ({exc})") from None
    if not container.streams.video:
        container.close()
        raise DataError(f"{where}: video {path} has no video stream PyAV can read (not a video, or a damaged one)")
    return container


def _count_packets(where: str, path: str, container) -> int:
    av = _pyav(where, path)
    try:
        return sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise DataError(f"{where}: video {path} cannot be read to its end ({exc})") from None


_HEADERS: dict[tuple, VideoHeader] = {}
"""Video headers read, by (path, size, mtime, inode): tokenizing, the sampled check and every
micro-batch read a video's header, and a container that stores no frame count is read through."""


def video_header(where: str, path: str) -> VideoHeader:
    """The header of the video at `path` (its frames counted from its packets, not decoded, where
    the container does not store the count); read once per version of the file."""
    try:
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    except OSError:
        key = None  # open_video names why
    if key in _HEADERS:
        return _HEADERS[key]
    with open_video(where, path) as container:
        stream = container.streams.video[0]
        frames = stream.frames or _count_packets(where, path, container)
        rate = stream.average_rate or stream.guessed_rate
        width, height = stream.codec_context.width, stream.codec_context.height
    if not (rate and width and height):
        raise DataError(f"{where}: video {path}: its header gives no frame rate or size")
    if len(_HEADERS) >= 4096:
        _HEADERS.clear()
    _HEADERS[key] = header = VideoHeader(frames, float(rate), width, height)
    return header


def decode_video(where: str, path: str, indices: list[int], size: tuple[int, int] | None = None):
    """The frames `indices` (ascending, without repeats) of the video at `path`, decoded, as an RGB
    array of (frames, height, width, 3); `size` (width, height): each frame scaled down to it as it
    is decoded, so a long 4K video's frames are never all held at full size. A video that ends or
    fails to decode before them is an error that names it."""
    import numpy as np

    av = _pyav(where, path)
    wanted, frames, number = set(indices), [], -1
    with open_video(where, path) as container:
        try:
            for number, frame in enumerate(container.decode(video=0)):
                if number in wanted:
                    scaled = size and (frame.width, frame.height) != size
                    frames.append((frame.reformat(*size, format="rgb24", interpolation="BICUBIC") if scaled
                                   else frame.reformat(format="rgb24")).to_ndarray())
                if number >= indices[-1]:
                    break
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise DataError(f"{where}: video {path} cannot be decoded past its frame {number + 1} ({exc})") from None
    if len(frames) != len(indices):
        raise DataError(f"{where}: video {path} ends before its frame {indices[len(frames)] + 1}: its header says "
                        "more frames than it holds (a truncated file?)")
    return np.stack(frames)


def verify_video(where: str, path: str) -> None:
    """Raise a DataError naming the record and the file if `path` is not a video PyAV reads: missing,
    not a regular file, no video stream, fewer packets than its header's frames (truncated), or a
    first frame that does not decode. Its later frames are decoded when training reads them."""
    header = video_header(where, path)
    if header.frames < MIN_VIDEO_FRAMES:
        raise DataError(f"{where}: video {path} has {header.frames} frame(s); a video needs at least "
                        f"{MIN_VIDEO_FRAMES}")
    with open_video(where, path) as container:
        packets = _count_packets(where, path, container)
    if packets < header.frames:
        raise DataError(f"{where}: video {path} holds {packets} of the {header.frames} frames its header says "
                        "(a truncated file?)")
    decode_video(where, path, [0])
    if max(header.width, header.height) > MAX_IMAGE_RATIO * min(header.width, header.height):
        raise DataError(f"{where}: video {path} is {header.width}x{header.height}: a side over {MAX_IMAGE_RATIO} "
                        "times the other, which the model's video processor refuses")


# ---- a bounded check of a local file before launch -------------------------------------------

SAMPLE_HEAD = 200                 # records read from the start of a file
SAMPLE_RANDOM = 16                # JSON-lines records read at seeded random offsets after those
WHOLE_FILE_LIMIT = 64 * 2**20     # JSON files are parsed whole (as the worker does) up to this size;
                                  # JSON-lines files get exact line numbers for random samples up to it
MAX_REPORTED = 3
_SNIFF = 8192


@dataclass(frozen=True)
class Sampled:
    """What a sample check found: problems of the file itself (unreadable, empty, a line that is not
    JSON or is too long), which stop any run, and of single records, which a job with `strict` off
    skips."""
    file: tuple[str, ...] = ()
    records: tuple[str, ...] = ()
    all_bad: bool = False
    """Every record checked has a problem."""

    def all(self) -> list[str]:
        return [*self.file, *self.records]


def sample_problems(entry: str, max_record_bytes: int, persona: Persona = Persona()) -> list[str]:
    """Problems in a bounded sample of a local dataset file (its first records and a few at random
    offsets), each naming `file:line` (or the byte offset in a large file); [] for hub ids and
    files that do not exist here."""
    return sampled(entry, max_record_bytes, persona).all()


def sampled(entry: str, max_record_bytes: int, persona: Persona = Persona()) -> Sampled:
    """sample_problems' findings, the file's apart from the records'. Cached per file version: the
    studio calls it on every edit."""
    try:
        source = parse_source(entry)
    except DataError as exc:
        return Sampled((str(exc),))
    path = Path(source.name).expanduser()
    if not source.is_local or not os.path.lexists(path):
        return Sampled()
    problem = not_a_regular_file(path)
    if problem:
        return Sampled((f"{path} {problem}, not a data file",))
    try:
        stat = path.stat()
    except OSError as exc:
        return Sampled((f"{path}: cannot read ({exc.strerror})",))
    return _sample_problems(str(path), stat.st_size, stat.st_mtime_ns, max_record_bytes, persona)


@functools.lru_cache(maxsize=64)
def _sample_problems(path_text: str, size: int, mtime_ns: int, max_record_bytes: int, persona: Persona) -> Sampled:
    path = Path(path_text)
    if size == 0:
        return Sampled((f"{path}: the file is empty (no records)",))
    suffix = path.suffix.lower()
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError as exc:
        return Sampled((f"{path}: cannot read ({exc.strerror})",))
    if suffix == ".parquet":
        return _parquet_sample(path, head, persona)
    binary = _binary_at(head, complete=size <= _SNIFF)
    if binary is not None:
        return Sampled((f"{path}: not a text file (binary data at byte {binary}); expected JSON lines, JSON, CSV or "
                        "parquet",))
    try:
        sample = {".json": _json_sample, ".csv": _csv_sample}.get(suffix)
        records = sample(path, size) if sample else _jsonl_sample(path, size, max_record_bytes)
        return _first_problems(path, records, persona)
    except DataError as exc:
        return Sampled((str(exc),))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        return Sampled((f"{path}: cannot read: {exc}",))


def _binary_at(head: bytes, complete: bool) -> int | None:
    """Byte offset of the first NUL or invalid UTF-8 in the file's first bytes, else None."""
    if b"\0" in head:
        return head.index(b"\0")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)
    except UnicodeDecodeError as exc:
        return exc.start
    return None


def _first_problems(path: Path, records: Iterator[Record], persona: Persona) -> Sampled:
    problems, checked = [], 0
    for record in records:
        checked += 1
        try:
            check_record(record, persona)
        except DataError as exc:
            problems.append(str(exc))
    if checked == 0:
        return Sampled((f"{path}: no records (only blank lines)",))
    bad = len(problems)
    if bad > MAX_REPORTED:
        problems = problems[:MAX_REPORTED] + [f"{path}: {bad - MAX_REPORTED} more bad records among the {checked} checked"]
    return Sampled(records=tuple(problems), all_bad=bad == checked)


def _jsonl_sample(path: Path, size: int, limit: int) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(_bounded_lines(f, limit), 1):
            if lineno > SAMPLE_HEAD:
                break
            where = f"{path}:{lineno}"
            if raw is None:
                raise _too_long(where, limit)
            if raw.strip():
                yield Record(where, _decoded_line(where, raw), str(path.parent))
        read = f.tell()
        if read >= size:
            return
        rng = random.Random(size)  # the same offsets for the same file on every check
        for offset in sorted({rng.randrange(read, size) for _ in range(SAMPLE_RANDOM)}):
            f.seek(offset)
            next(_bounded_lines(f, 0), None)  # the rest of the line the offset fell into
            start = f.tell()
            raw = next(_bounded_lines(f, limit), b"")
            where = (f"{path}:{_line_at(path, start)}" if size <= WHOLE_FILE_LIMIT
                     else f"{path}: the line at byte {start}")
            if raw is None:
                raise _too_long(where, limit)
            if raw.strip():
                yield Record(where, _decoded_line(where, raw), str(path.parent))


def _line_at(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _decoded_line(where: str, raw: bytes) -> Any:
    try:
        return _json_line(where, raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 text (byte {exc.start} of the line)") from None


def _json_sample(path: Path, size: int) -> Iterator[Record]:
    if size > WHOLE_FILE_LIMIT:
        return iter(())
    entries, _ = _json(path)
    chosen = list(range(min(SAMPLE_HEAD, len(entries))))
    if len(entries) > SAMPLE_HEAD:
        chosen += sorted(random.Random(size).sample(range(SAMPLE_HEAD, len(entries)),
                                                    min(SAMPLE_RANDOM, len(entries) - SAMPLE_HEAD)))
    return (Record(*entries[i], str(path.parent)) for i in chosen)


def _csv_sample(path: Path, size: int) -> Iterator[Record]:
    # CSV fields may span lines, so only the head is read (a random offset can land inside a field).
    with open(path, encoding="utf-8", newline="") as f:
        for count, (where, row) in enumerate(_csv_rows(path, f)):
            if count >= SAMPLE_HEAD:
                break
            yield Record(where, row, str(path.parent))


def _parquet_sample(path: Path, head: bytes, persona: Persona) -> Sampled:
    if not head.startswith(b"PAR1"):
        return Sampled((f"{path}: not a parquet file (it does not start with the PAR1 magic bytes)",))
    try:
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=SAMPLE_HEAD), None)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        return Sampled((f"{path}: cannot read parquet ({exc})",))
    rows = batch.to_pylist() if batch is not None else []
    return _first_problems(path, (Record(f"{path}: row {i + 1}", row, str(path.parent)) for i, row in enumerate(rows)), persona)
