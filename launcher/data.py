"""Training data: read records (local files or HF datasets ids), turn them into token ids and
labels, pack or pad them into micro-batches.

Each rank reads only its shard (record i belongs to rank i % world_size) and tokenizes it before
training starts, so a bad record stops the job at once with its file and line, not at step 900.
"""
from __future__ import annotations

import bisect
import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from backend.jsonfile import read_json

IGNORE = -100
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# ChatML, used when a tokenizer ships without a chat template (base models).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class DataError(Exception):
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


def read_records(source: Source, rank: int, world: int, seed: int) -> Iterator[Record]:
    """This rank's records of one source. JSON-lines and CSV files are streamed (twice: once to
    count) and only this rank's JSON lines are parsed; JSON and parquet files are read whole."""
    if not source.is_local:
        yield from _hub_records(source, rank, world, seed)
        return
    path = Path(source.name)
    if not path.is_file():
        raise DataError(f"dataset file {path} not found")
    reader = {".json": _json, ".csv": _csv, ".parquet": _parquet}.get(path.suffix.lower(), _jsonl)
    entries, decode = reader(path)
    indices = _selected(len(entries), source.limit, seed)
    for index, (where, raw) in enumerate(entries):
        if index in indices and indices[index] % world == rank:
            yield Record(where, decode(where, raw))


def _selected(total: int, limit: int | None, seed: int) -> dict[int, int]:
    """Record index → position in the selection (positions decide the rank)."""
    order = list(range(total))
    if limit is not None and limit < total:
        random.Random(seed).shuffle(order)
        order = sorted(order[:limit])
    return {index: pos for pos, index in enumerate(order)}


class Entries(Protocol):
    """(where, raw record) pairs that can be counted, then read."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[str, Any]]: ...


Decode = Callable[[str, Any], Any]


class _FileRows:
    """A file's records as (where, raw), read from disk on each pass (the file may not fit in
    memory); `rows` splits the open file into them."""

    def __init__(self, path: Path, rows: Callable[[Path, Any], Iterator[tuple[str, Any]]]):
        self.path, self.rows = path, rows

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        with open(self.path, encoding="utf-8", newline="") as f:
            yield from self.rows(self.path, f)


def _jsonl_rows(path: Path, f) -> Iterator[tuple[str, str]]:
    for lineno, line in enumerate(f, 1):
        if line.strip():
            yield f"{path}:{lineno}", line


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


def _jsonl(path: Path) -> tuple[Entries, Decode]:
    return _FileRows(path, _jsonl_rows), _json_line


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


def _hub_records(source: Source, rank: int, world: int, seed: int) -> Iterator[Record]:
    import datasets

    try:
        ds = datasets.load_dataset(source.name, split="train")
    except Exception as exc:  # network, missing dataset, auth: all user-facing
        raise DataError(f"dataset '{source.name}': cannot load from the hub ({exc})") from None
    if source.limit is not None and source.limit < len(ds):
        ds = ds.shuffle(seed=seed).select(range(source.limit))
    for index in range(rank, len(ds), world):
        yield Record(f"{source.name}[{index}]", ds[index])


# ---- formats -------------------------------------------------------------------------------


def to_messages(record: Record) -> tuple[list[dict[str, str]] | None, str | None]:
    """(chat messages, None) for chat-like records or (None, text) for plain text records."""
    data = record.data
    if not isinstance(data, dict):
        raise DataError(f"{record.where}: expected an object with fields, got {type(data).__name__}")
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
                    "'instruction'+'output', 'query'+'response', 'text' or 'input_ids'")


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
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise DataError(f"{record.where}: message {i + 1} needs a 'role' (system/user/assistant/tool) "
                            f"and a string 'content'")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{record.where}: no assistant message, nothing to learn from")
    return out


# ---- tokenization --------------------------------------------------------------------------


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(record: Record, tokenizer, max_length: int) -> Sample | None:
    """Token ids and labels (IGNORE outside the assistant responses of chat data), truncated.
    None when truncation left no token to learn from."""
    if isinstance(record.data, dict) and "input_ids" in record.data:
        return _pretokenized(record, max_length)
    messages, text = to_messages(record)
    if messages is None:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        ids = ids[:max_length]
        return Sample(ids, list(ids)) if len(ids) > 1 else None
    ids: list[int] = []
    labels: list[int] = []
    # Render prefix by prefix: the tokens an assistant turn adds to the rendered conversation
    # are its response (works for any template, no `{% generation %}` markers needed).
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(prompt)] != prompt or full[: len(ids)] != ids:
            raise DataError(f"{record.where}: the chat template does not render conversations prefix-stably; "
                            "cannot locate the response tokens")
        labels += [IGNORE] * (len(prompt) - len(ids)) + full[len(prompt):]
        ids = full
    ids, labels = ids[:max_length], labels[:max_length]
    return Sample(ids, labels) if any(label != IGNORE for label in labels[1:]) else None


def _pretokenized(record: Record, max_length: int) -> Sample | None:
    """Records that already hold token ids (`input_ids`, optional `labels`, -100 = no loss)."""
    ids, labels = record.data["input_ids"], record.data.get("labels", record.data["input_ids"])
    if not (isinstance(ids, list) and isinstance(labels, list) and len(ids) == len(labels) and ids
            and all(isinstance(t, int) for t in ids + labels)):
        raise DataError(f"{record.where}: 'input_ids' (and 'labels') must be equally long, non-empty lists of integers")
    ids, labels = ids[:max_length], labels[:max_length]
    return Sample(ids, labels) if any(label != IGNORE for label in labels[1:]) else None


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_samples(datasets: list[str], tokenizer, max_length: int, rank: int, world: int, seed: int) -> tuple[list[Sample], int]:
    """This rank's encoded samples and how many were dropped because truncation left no labels.
    Raises DataError on the first bad record."""
    samples, dropped = [], 0
    for entry in datasets:
        for record in read_records(parse_source(entry), rank, world, seed):
            sample = encode(record, tokenizer, max_length)
            if sample is None:
                dropped += 1
            else:
                samples.append(sample)
    return samples, dropped


# ---- packing and batching ------------------------------------------------------------------


@dataclass
class Row:
    """One training sequence: a padded sample, or several samples packed with restarting positions."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    n_samples: int


def pack(samples: list[Sample], max_length: int) -> list[Row]:
    """Best-fit decreasing bin packing into rows of at most `max_length` tokens: longest sample
    first, each into the fullest row that still has room (rows come out 99% full on lengths
    spread evenly over 50-2,048 tokens, where filling rows in data order left ~25% padding).
    Inside a row the samples keep their data order. Position ids restart at 0 for every sample,
    which is how transformers' mask builders (and flash-attention's varlen path) tell samples
    apart when no attention mask is passed, so no token attends across samples. The first label
    of every sample is ignored: it would be predicted from the previous sample."""
    members: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted: the best fit is found by bisection
    for index in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        size = len(samples[index])
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            members.append([index])
            free, row = max_length - size, len(members) - 1
        else:
            free, row = room.pop(at)
            members[row].append(index)
            free -= size
        if free > 0:
            bisect.insort(room, (free, row))
    rows = []
    for indices in members:
        row = Row([], [], [], 0)
        for sample in (samples[i] for i in sorted(indices)):
            row.input_ids += sample.input_ids
            row.labels += [IGNORE] + sample.labels[1:]
            row.position_ids += list(range(len(sample)))
            row.n_samples += 1
        rows.append(row)
    return rows


def unpacked(samples: list[Sample]) -> list[Row]:
    return [Row(s.input_ids, s.labels, list(range(len(s))), 1) for s in samples]


def collate(rows: list[Row], pad_id: int, packed: bool, pad_to: int | None = None) -> dict:
    """Tensors for one micro-batch. Packed rows get no attention mask (the position ids carry the
    sample boundaries; padding forms its own block); padded rows get one."""
    import torch

    width = pad_to or max(len(r.input_ids) for r in rows)
    ids, labels, pos, mask = [], [], [], []
    for r in rows:
        pad = width - len(r.input_ids)
        ids.append(r.input_ids + [pad_id] * pad)
        labels.append(r.labels + [IGNORE] * pad)
        pos.append(r.position_ids + list(range(pad)))
        mask.append([1] * len(r.input_ids) + [0] * pad)
    batch = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(pos)}
    if not packed:
        batch["attention_mask"] = torch.tensor(mask)
    return batch


class Batches:
    """Micro-batches of one rank, reshuffled every epoch with a seed, addressable by global
    optimizer step so a resume continues at the exact data position."""

    def __init__(self, rows: list[Row], micro_batch: int, accumulation: int, steps_per_epoch: int,
                 seed: int, pad_id: int, packed: bool, max_length: int):
        self.rows, self.micro_batch, self.accumulation = rows, micro_batch, accumulation
        self.steps_per_epoch, self.seed, self.pad_id, self.packed = steps_per_epoch, seed, pad_id, packed
        self.max_length = max_length
        self._epoch: int | None = None
        self._epoch_order: list[int] = []

    def _order(self, epoch: int) -> list[int]:
        # Shuffling is O(rows); steps ask for the same epoch thousands of times in a row.
        if epoch != self._epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._epoch, self._epoch_order = epoch, order
        return self._epoch_order

    def step(self, step: int) -> list[tuple[dict, int, int]]:
        """Micro-batches of optimizer step `step` (0-based): (batch, tokens, samples) each."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        out = []
        for micro in range(self.accumulation):
            start = (within * self.accumulation + micro) * self.micro_batch
            rows = [self.rows[i] for i in order[start:start + self.micro_batch]]
            batch = collate(rows, self.pad_id, self.packed, self.max_length if self.packed else None)
            out.append((batch, sum(len(r.input_ids) for r in rows), sum(r.n_samples for r in rows)))
        return out


def steps_per_epoch(rows_per_rank: int, micro_batch: int, accumulation: int) -> int:
    return rows_per_rank // (micro_batch * accumulation)


def total_steps(max_steps: int, num_train_epochs: float, per_epoch: int) -> int:
    import math

    return max_steps if max_steps > 0 else max(1, math.ceil(num_train_epochs * per_epoch))
