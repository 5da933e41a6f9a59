"""Streamed training data (`streaming: true`, ms-swift's name): records read as the steps ask for
them, tokenized by the rank that keeps them and packed on the fly. Nothing is listed, counted or
cached, so a dataset larger than memory or disk trains in flat memory.

Hugging Face `datasets` reads: an IterableDataset per dataset entry, split among the data-parallel
ranks with `split_dataset_by_node` (whole files to each rank where an entry has as many shards as a
multiple of the ranks, else every n-th record), the entries one after another. Every checkpoint
keeps each rank's position in it (`state_dict`) with the samples it had read but not trained on, so
a resume trains on the next records: none twice, none skipped. A stream is read once, in file order
(not shuffled): `max_steps` says how long to train, and data that ends first ends the run.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from backend.job.records import (DataError, Persona, ReaderMissing, Source, decode_streamed, parse_source,
                                 streamed_entries)
from launcher.data import Pair, Row, Sample, encode_checked, micro_batch, pack_plan, packed_row, padded_row
from launcher.tokenized import NAMED_SKIPS

log = logging.getLogger(__name__)

STATE = "data-rank{rank}.json"
"""A rank's position in the stream, in each checkpoint (JSON: a checkpoint runs no code it reads)."""


def open_stream(spec, tokenizer, dp_rank: int, dp_size: int, images=None):
    """The records of data-parallel rank `dp_rank`, tokenized as they are read: rows of
    input_ids, labels (both empty where truncation left no response), error (a bad record's
    message, which ends the run naming its file and line when the rank reaches it) and skipped
    (`strict` off: why a record that cannot be encoded is passed over, as the tokenized cache
    does; a record that is not JSON, or a file that cannot be read, is still an error). `images`: a
    vision-language model's `launcher.vision.Images` (each record's images counted as it is read)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    datasets.disable_progress_bars()
    sources = [parse_source(entry) for entry in spec.dataset]
    # The local files are one generator, so one shard: split_dataset_by_node gives every rank
    # every n-th record of it (with a shard per file, whole files would go to ranks unevenly).
    local = tuple((s.name, s.limit) for s in sources if s.is_local)
    parts = [_hub(s) for s in sources if not s.is_local]
    if local:
        parts.insert(0, datasets.IterableDataset.from_generator(_local_rows, features=_raw_features(), gen_kwargs={
            "sources": local, "max_record_bytes": spec.max_record_bytes}))
    stream = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    # Where datasets splits by records (shards not a multiple of the ranks), it maps every record
    # before it skips the other ranks' (datasets 5.2): each rank would tokenize all of them. The
    # map sees the records' indices before the split, so it passes over the others' itself.
    stepped = dp_size > 1 and stream.num_shards % dp_size != 0
    stream = split_dataset_by_node(stream, rank=dp_rank, world_size=dp_size)
    return stream.map(_encoded, with_indices=True, remove_columns=["where", "raw", "base"], features=_features(), fn_kwargs={
        "tokenizer": tokenizer, "max_length": spec.max_length, "images": images,
        "persona": images.persona(spec) if images is not None else Persona.of(spec),
        "mine": (dp_rank, dp_size) if stepped else None, "strict": spec.strict})


def _raw_features():
    from datasets import Features, Value

    # base: a local file's directory, where its records' relative image paths lead
    return Features({"where": Value("string"), "raw": Value("binary"), "base": Value("string"), "error": Value("string")})


def _features():
    from datasets import Features, Sequence, Value

    return Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                     "rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int32")),
                     "images": Sequence(Value("string")), "error": Value("string"), "skipped": Value("string")})


def _local_rows(sources: tuple[tuple[str, int | None], ...], max_record_bytes: int):
    """The local files' records in turn, `name#N`'s first N of its file."""
    for name, limit in sources:
        base = str(Path(name).parent)
        try:
            for count, (where, raw) in enumerate(streamed_entries(Source(name), max_record_bytes), 1):
                yield {"where": where, "raw": raw, "base": base, "error": None}
                if count == limit:
                    break
        except DataError as exc:  # a line too long, a parquet file that cannot be read: named where met
            yield {"where": name, "raw": b"", "base": base, "error": str(exc)}


def _hub(source):
    import datasets

    try:
        ds = datasets.load_dataset(source.name, split="train", streaming=True)
    except Exception as exc:  # network, missing dataset, auth: all user-facing
        raise DataError(f"dataset '{source.name}': cannot load from the hub ({exc})") from None

    def as_raw(record: dict, index: int) -> dict:
        where = f"{source.name}[{index}]"
        try:
            return {"where": where, "raw": json.dumps(record, ensure_ascii=False).encode(), "base": "", "error": None}
        except (TypeError, ValueError) as exc:
            return {"where": where, "raw": b"", "base": "", "error": f"{where}: a value that is not JSON text ({exc})"}
    ds = ds.map(as_raw, with_indices=True).select_columns(["where", "raw", "base", "error"])
    return ds if source.limit is None else ds.take(source.limit)  # the first N: a stream is not shuffled


def _encoded(row: dict, index: int, tokenizer, max_length: int, persona: Persona,
             mine: tuple[int, int] | None, strict: bool = True, images=None) -> dict[str, Any]:
    """A record's tokens (a preference pair's chosen answer, and its rejected one in the `rejected_`
    columns) and image files; all empty where it is another rank's or truncation left no answer."""
    empty = {"input_ids": [], "labels": [], "rejected_input_ids": [], "rejected_labels": [], "images": [],
             "error": None, "skipped": None}
    if mine is not None and index % mine[1] != mine[0]:
        return empty  # another rank's: dropped by the split
    if row["error"]:
        return {**empty, "error": row["error"]}
    try:
        record = decode_streamed(row["where"], row["raw"], row["base"])
    except DataError as exc:  # not JSON: no record to skip, as the tokenized cache has it
        return {**empty, "error": str(exc)}
    try:
        sample = encode_checked(record, tokenizer, max_length, persona, images, strict)
    except Exception as exc:  # a chat template's raise_exception (roles out of turn) too
        failure = str(exc) if isinstance(exc, DataError) else f"{record.where}: {type(exc).__name__}: {exc}"
        # a missing reader (PyAV, torchvision) is not the record's fault: never a record skipped
        return {**empty, "error" if strict or isinstance(exc, ReaderMissing) else "skipped": failure}
    if sample is None:
        return empty
    if isinstance(sample, Pair):
        return {**empty, "input_ids": sample.chosen.input_ids, "labels": sample.chosen.labels,
                "rejected_input_ids": sample.rejected.input_ids, "rejected_labels": sample.rejected.labels,
                "images": sample.chosen.images}
    return {**empty, "input_ids": sample.input_ids, "labels": sample.labels, "images": sample.images}


class StreamBatches:
    """A rank's micro-batches from its stream, one step after the other (a stream cannot be
    addressed by step: the trainer asks for each step once, in order). Packed: samples are drawn
    until they hold twice the step's rows' worth of tokens, the fullest rows pack_plan makes of
    them are trained, and the rest wait for the next step."""

    def __init__(self, stream, dp_size: int, micro_batch: int, accumulation: int, pad_id: int, packed: bool,
                 max_length: int, multiple: int = 1, flat: bool = False):
        self.stream, self.dp_size, self.flat = stream, dp_size, flat
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.pad_id, self.packed, self.max_length, self.multiple = pad_id, packed, max_length, multiple
        self.buffer: list[Sample | Pair] = []
        self.records = self.dropped = self.skipped = 0
        self.skipped_first: list[str] = []
        """Why the rank's first NAMED_SKIPS skipped records (strict off) were skipped."""
        self.error: str | None = None
        """A bad record's message, once the rank has met one."""
        self._iterator = None
        self._next_step = 0
        self._positions: dict[int, dict] = {}
        self.media = None
        """A vision-language model's `launcher.vision.Images`: the micro-batches' pixel inputs."""

    # ---- position ----------------------------------------------------------------------

    def position(self, step: int) -> dict:
        """Where the stream stood before step `step` (0-based) took its data: what a checkpoint
        after `step` steps keeps. The trainer fetches a step before it saves the one before, except
        after the last step (max_steps): then nothing was taken since, and the stream stands there."""
        return self._snapshot() if step == self._next_step else self._positions[step]

    def restore(self, state: Any, step: int, where: Path) -> None:
        """Continue from `position(step)` as a checkpoint kept it (in `where`)."""
        try:
            if state["dp_size"] != self.dp_size:
                raise DataError(f"resume: {where} streamed its data over {state['dp_size']} data-parallel ranks and "
                                f"this job has {self.dp_size}: a stream's position belongs to its rank; resume "
                                "with the layout it was written with")
            buffer = [_sample(*entry) for entry in state["buffer"]]
            records, dropped, stream_state = int(state["records"]), int(state["dropped"]), state["stream"]
            # a position written before records were skipped has neither
            skipped, first = int(state.get("skipped", 0)), state.get("skipped_first", [])
            if not isinstance(stream_state, dict):
                raise TypeError("stream is not a mapping")
            if not (isinstance(first, list) and all(isinstance(m, str) for m in first)):
                raise TypeError("skipped_first is not a list of messages")
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"resume: {where} is not a stream position ({type(exc).__name__}: {exc})") from None
        try:
            self.stream.load_state_dict(stream_state)
        except Exception as exc:  # datasets checks the state against the stream's own shape
            raise DataError(f"resume: {where} is the position of another stream than this job's datasets "
                            f"({type(exc).__name__}: {exc})") from None
        self.buffer, self.records, self.dropped = buffer, records, dropped
        self.skipped, self.skipped_first = skipped, first[:NAMED_SKIPS]
        self._next_step = step

    def _snapshot(self) -> dict:
        return {"dp_size": self.dp_size, "stream": self.stream.state_dict(), "records": self.records,
                "dropped": self.dropped, "skipped": self.skipped, "skipped_first": list(self.skipped_first),
                "buffer": [_entry(s) for s in self.buffer]}

    # ---- steps -------------------------------------------------------------------------

    def step(self, step: int) -> list[tuple[dict, int, int]] | None:
        """Micro-batches of optimizer step `step`; None when the data ended first or a bad record
        was met (`error`)."""
        if step != self._next_step:
            raise RuntimeError(f"stream asked for step {step}, expected {self._next_step}")
        self._positions = {step: self._snapshot(), **{s: p for s, p in self._positions.items() if s == step - 1}}
        self._next_step += 1
        try:
            groups = self._packed_rows() if self.packed else self._padded_rows()
        except DataError as exc:
            self.error = str(exc)
            return None
        if groups is None:
            return None
        return [micro_batch(rows, self.pad_id, self.packed, self.max_length, self.multiple, self.flat, self.media)
                for rows in groups]

    def _draw(self) -> Sample | None:
        if self._iterator is None:
            self._iterator = iter(self.stream)
        while (row := next(self._iterator, None)) is not None:
            self.records += 1
            if row["error"]:
                raise DataError(row["error"])
            if row["skipped"]:
                self.skipped += 1
                if len(self.skipped_first) < NAMED_SKIPS:
                    self.skipped_first.append(row["skipped"])
                    log.warning("data: a record skipped (strict is off): %s", row["skipped"])
                continue
            if row["input_ids"]:
                return _sample(row["input_ids"], row["labels"], row["rejected_input_ids"], row["rejected_labels"],
                               row["images"])
            self.dropped += 1
        return None

    def _padded_rows(self) -> list[list[Row]] | None:
        """The step's micro-batches' rows; a micro-batch of pairs is its chosen rows, then their
        rejected rows (as `data.Batches` makes them)."""
        need = self.micro_batch * self.accumulation
        while len(self.buffer) < need and (sample := self._draw()) is not None:
            self.buffer.append(sample)
        if len(self.buffer) < need:
            return None
        taken, self.buffer = self.buffer[:need], self.buffer[need:]
        groups = [taken[start:start + self.micro_batch] for start in range(0, need, self.micro_batch)]
        if isinstance(taken[0], Pair):
            return [[padded_row(p.chosen) for p in g] + [padded_row(p.rejected, counted=False) for p in g]
                    for g in groups]
        return [[padded_row(sample) for sample in g] for g in groups]

    def _packed_rows(self) -> list[list[Row]] | None:
        need = self.micro_batch * self.accumulation
        tokens = sum(len(s) for s in self.buffer)
        while tokens < 2 * need * self.max_length and (sample := self._draw()) is not None:
            self.buffer.append(sample)
            tokens += len(sample)
        lengths = np.array([len(s) for s in self.buffer], dtype=np.int64)
        plan = pack_plan(lengths, self.max_length)
        if len(plan) < need:
            return None
        fill = [int(lengths[plan.row(r)].sum()) for r in range(len(plan))]
        chosen = sorted(sorted(range(len(plan)), key=lambda r: -fill[r])[:need], key=lambda r: int(plan.row(r).min()))
        used = {int(i) for r in chosen for i in plan.row(r)}
        rows = [packed_row([self.buffer[i] for i in sorted(plan.row(r).tolist())]) for r in chosen]
        self.buffer = [s for i, s in enumerate(self.buffer) if i not in used]
        return [rows[start:start + self.micro_batch] for start in range(0, need, self.micro_batch)]


def _sample(ids, labels, rejected_ids=(), rejected_labels=(), images=()) -> Sample | Pair:
    """A streamed or kept sample: a pair where it has a rejected answer (its images in both rows).
    Every token an integer, every image a path or inline image (a position file is read back
    through this)."""
    if not all(isinstance(image, str) for image in images):
        raise TypeError("an image is not a path")
    sample = Sample([int(t) for t in ids], [int(t) for t in labels], list(images))
    return Pair(sample, Sample([int(t) for t in rejected_ids], [int(t) for t in rejected_labels], list(images))) \
        if rejected_ids else sample


def _entry(sample: Sample | Pair) -> list:
    if isinstance(sample, Pair):
        return [sample.chosen.input_ids, sample.chosen.labels, sample.rejected.input_ids, sample.rejected.labels,
                sample.chosen.images]
    return [sample.input_ids, sample.labels, [], [], sample.images]


def save_position(batches: StreamBatches, step: int, directory: Path, rank: int) -> None:
    (directory / STATE.format(rank=rank)).write_text(json.dumps(batches.position(step)))


def load_position(batches: StreamBatches, step: int, directory: Path, rank: int) -> None:
    path = directory / STATE.format(rank=rank)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"resume: {directory} holds no stream position for rank {rank} ({path.name}): it was not "
                        "written by a streaming job of this layout; resume it with streaming off") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"resume: {path} cannot be read ({exc})") from None
    batches.restore(state, step, path)
