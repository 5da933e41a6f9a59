"""Tokenized datasets in Arrow: a job's records become token ids and labels once per set of inputs
(the dataset files as they are now, the tokenizer and its chat template, max_length, the job's
system prompt and names, the record bound), kept in a cache directory that runs and resumes share
and that every rank memory-maps.

One process tokenizes, with `dataset_num_proc` workers (`datasets`' generator builder); every
other process that needs the same entry (the run's other ranks, another run, a resume) waits on
the entry's lock and reads the result. An entry appears whole or not at all: it is written into a
directory of its own and renamed into place. A bad record is kept as the entry's failure (the same
inputs give the same error), so the waiting ranks report it without tokenizing again; with
`strict` off a record that cannot be encoded is kept as a skipped row instead, and the entry's MARKER
counts and names them.

Layout of the cache directory:
    <key>/             TOKENS (one Arrow IPC file, memory-mapped by the ranks) and MARKER
    <key>.lock         the builders' lock (flock)
    <key>.failed.json  the DataError the inputs give
    .tmp-<key>-<hex>/  an entry being written (BUILDING inside); a killed builder's is removed by the next
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from backend.job.jsonfile import write_json_atomic
from backend.job.paths import not_a_regular_file
from backend.job.records import (DataError, Persona, ReaderMissing, Source, hub_dataset, parse_source,
                                 positioned_records)
from launcher.data import Pair, Sample, encode_checked

FORMAT = 4
"""Bumped when what an entry holds changes: older entries are then not read."""
MARKER = "swift-studio-tokenized.json"
TOKENS = "tokens.arrow"
COLUMNS = ["input_ids", "labels", "length", "source", "position", "rejected_input_ids", "rejected_labels", "images"]
COLUMN_TYPES = ["list<item: int32>", "list<item: int32>", "int32", "int32", "int64", "list<item: int32>",
                "list<item: int32>", "list<item: string>"]
"""A preference pair's chosen answer is in input_ids/labels, its rejected one in rejected_*
(empty for other records); length counts both (0: truncation left no answer, SKIPPED: the record
could not be encoded and `strict` is off). `images`: a vision-language sample's image files."""
SKIPPED = -1
NAMED_SKIPS = 10
"""How many skipped records an entry names (all are counted)."""
BUILDING = ".swift-studio-building"
VERSION_BYTES = 1 << 20
"""Bytes at each end of a local file hashed into its version, beside its size and modification time."""


HEARTBEAT_S = 30.0
"""How often a rank that tokenizes, or waits for another process's tokenization, says so: the hang
watch counts a run as starting up, not hung, while these come."""
DEFAULT_DIR = ".tokenized"
"""Beside the run directories (in output_dir) where dataset_cache_dir is not set; a run id never
starts with a dot."""


def dataset_cache_dir(spec, run_dir: Path) -> Path:
    return Path(spec.dataset_cache_dir) if spec.dataset_cache_dir else Path(run_dir).parent / DEFAULT_DIR


class DataHeartbeat:
    """While the data is prepared: a `data` event every HEARTBEAT_S with the seconds so far."""

    def __init__(self, events, every_s: float = HEARTBEAT_S):
        self.events, self.every_s = events, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="data-heartbeat", daemon=True)

    def __enter__(self) -> "DataHeartbeat":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._done.wait(self.every_s):
            self.events.emit("data", phase="preparing", elapsed_s=round(time.monotonic() - self._started, 1))


class CacheError(DataError):
    """The cache directory cannot be used (not writable, full, a damaged entry): named with its path."""


@dataclass
class Tokenized:
    """One cache entry, memory-mapped: every record of the job's datasets in order of (dataset,
    position), dropped ones (no response token left within max_length) with length 0, skipped ones
    (not `strict`: the record could not be encoded) with length SKIPPED."""

    table: Any  # pyarrow.Table over the memory-mapped TOKENS file: input_ids, labels, length, source, position
    entry: Path
    built: bool
    """Whether this process tokenized it (False: it was there, or another process built it while this one waited)."""
    seconds: float
    skipped: int = 0
    """Records skipped (strict off): counted over the whole entry, not by shard."""
    skipped_first: tuple[str, ...] = ()
    """The first NAMED_SKIPS of them (by dataset, then position), each the error that skipped it."""

    def __post_init__(self) -> None:
        self._batches = self.table.select(["input_ids", "labels", "rejected_input_ids", "rejected_labels",
                                           "images"]).to_batches()
        self._offsets = np.cumsum([0] + [len(b) for b in self._batches])

    def shard(self, rank: int, world: int, among: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Rows of data-parallel rank `rank` of `world`, in the order the ranks have always read them
        (each dataset in turn, its records whose position % world == rank), and how many of that
        shard's records were dropped (no answer left within max_length; skipped ones are counted by
        the entry); `among`: only the rows where this mask is true."""
        source = _numbers(self.table.column("source"))
        position = _numbers(self.table.column("position"))
        taken = position % world == rank
        mine = np.nonzero(taken if among is None else taken & among)[0]
        mine = mine[np.lexsort((position[mine], source[mine]))]
        length = _numbers(self.table.column("length"))[mine]
        return mine[length > 0], int(np.count_nonzero(length == 0))

    def held_out(self, ratio: float, seed: int) -> np.ndarray:
        """The rows split off for validation (`split_dataset_ratio`): a seeded choice of
        round(ratio x records) of them, at least one, the same on every rank; skipped records are
        not among them."""
        usable = np.nonzero(_numbers(self.table.column("length")) != SKIPPED)[0]
        mask = np.zeros(self.table.num_rows, dtype=bool)
        mask[usable[np.random.default_rng(seed).permutation(len(usable))[:max(1, round(ratio * len(usable)))]]] = True
        return mask

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return _numbers(self.table.column("length"))[rows]

    def samples(self, rows: np.ndarray | list[int]) -> list[Sample | Pair]:
        # Row by row from their record batches: a take on the whole table would first join every
        # batch of the column into memory (1.3 GB for a million short chats).
        out = []
        for row in np.asarray(rows, dtype=np.int64).tolist():
            at = int(np.searchsorted(self._offsets, row, side="right")) - 1
            ids, labels, rejected_ids, rejected_labels, images = (
                column[0].as_py() for column in self._batches[at].slice(row - int(self._offsets[at]), 1).columns)
            sample = Sample(ids, labels, images)
            out.append(Pair(sample, Sample(rejected_ids, rejected_labels, images)) if rejected_ids else sample)
        return out


def cache_key(spec, tokenizer, images=None) -> tuple[str, dict[str, Any]]:
    """The entry's name and what it was made from (kept in its MARKER). `images`: a vision-language
    model's `launcher.vision.Images` (its image processor sets each image's token count)."""
    sources = [parse_source(entry) for entry in spec.dataset]
    inputs = {
        "format": FORMAT,
        "datasets": [source_version(s, spec.seed) for s in sources],
        "tokenizer": tokenizer_digest(tokenizer),
        "max_length": spec.max_length,
        "max_record_bytes": spec.max_record_bytes,
        "persona": [spec.system, spec.model_name, spec.model_author, spec.columns, spec.rlhf_type is not None],
        "images": images.digest() if images is not None else None,
        "strict": spec.strict,
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    return key, inputs


def source_version(source: Source, seed: int) -> dict[str, Any]:
    """What a dataset entry is now: a local file by its path, size, modification time and the hash
    of its first and last MiB (an edit that keeps size and time to the nanosecond is not seen); a
    hub dataset by the fingerprint `datasets` gives its download."""
    picked = {"limit": source.limit, "seed": seed if source.limit else None}
    if not source.is_local:
        return {"hub": source.name, "fingerprint": hub_dataset(source, seed)._fingerprint, **picked}
    path = Path(source.name).resolve()
    problem = not_a_regular_file(path)
    if problem:
        raise DataError(f"dataset file {path} {problem}")
    try:
        st = path.stat()
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(VERSION_BYTES))
            if st.st_size > 2 * VERSION_BYTES:
                f.seek(st.st_size - VERSION_BYTES)
                digest.update(f.read(VERSION_BYTES))
    except OSError as exc:
        raise DataError(f"dataset file {path}: {exc.strerror or exc}") from None
    return {"file": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": digest.hexdigest(), **picked}


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer as it encodes: its full definition (a fast tokenizer's JSON, else its vocabulary)
    and the chat template and special tokens the worker renders with."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None
                   else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
    digest.update(json.dumps([type(tokenizer).__name__, tokenizer.chat_template, tokenizer.eos_token_id,
                              tokenizer.bos_token_id, tokenizer.pad_token_id], default=str).encode())
    return digest.hexdigest()


def open_tokenized(spec, tokenizer, cache_dir: Path, images=None) -> Tokenized:
    """The job's tokenized data: read from the cache, or tokenized into it by this process (while
    holding the entry's lock, so no other process does the same work). Raises DataError for a bad
    record (file:line) and CacheError naming the cache directory."""
    started = time.monotonic()
    key, inputs = cache_key(spec, tokenizer, images)
    entry = cache_dir / key
    built = False
    if not (entry / MARKER).is_file():
        with _locked(cache_dir, key):
            failed = cache_dir / f"{key}.failed.json"
            if failed.is_file():
                raise DataError(_read_failure(failed))
            if not (entry / MARKER).is_file():
                _build(spec, tokenizer, cache_dir, key, inputs, images)
                built = True
    table, skipped = _open(entry, inputs)
    return Tokenized(table, entry, built, time.monotonic() - started, skipped["count"], tuple(skipped["first"]))


def _open(entry: Path, inputs: dict[str, Any]):
    """The entry's table, memory-mapped (pyarrow alone: a rank that reads the cache never imports
    `datasets`), and its MARKER's account of the skipped records."""
    import pyarrow as pa

    try:
        marker = json.loads((entry / MARKER).read_text())
        if marker.get("inputs") != inputs:
            raise ValueError(f"{MARKER} does not describe this job's inputs")
        skipped = marker["skipped"]
        if not (isinstance(skipped.get("count"), int) and isinstance(skipped.get("first"), list)):
            raise ValueError(f"{MARKER}: 'skipped' is not a count and a list")
        table = pa.ipc.open_file(pa.memory_map(str(entry / TOKENS))).read_all()
        found = [f"{field.name}: {field.type}" for field in table.schema]
        if found != [f"{name}: {kind}" for name, kind in zip(COLUMNS, COLUMN_TYPES)]:
            raise ValueError(f"columns {', '.join(found)}, expected {COLUMNS} of types {COLUMN_TYPES}")
        if any(table.column(name).null_count for name in COLUMNS):
            raise ValueError("a column has missing values")
        return table, skipped
    except Exception as exc:  # a damaged or foreign entry: named, never removed (it is not this process's)
        raise CacheError(f"dataset_cache_dir: the tokenized data in {entry} cannot be read ({exc}); "
                         "remove that directory to tokenize again") from None


def _numbers(column) -> np.ndarray:
    """A fixed-width column without missing values (`_open` checked both) as numpy, read from its
    buffers: pyarrow's own to_numpy imports pandas (pyarrow 26), 0.45 s of every rank's start."""
    dtype = np.dtype(str(column.type))
    return np.concatenate([np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)
                           for chunk in column.chunks] or [np.zeros(0, dtype)])


@contextmanager
def _locked(cache_dir: Path, key: str) -> Iterator[None]:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CacheError(f"dataset_cache_dir: cannot write to {cache_dir} ({exc.strerror or exc}); "
                         "set dataset_cache_dir to a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # ENOLCK: a network file system mounted without locking
            raise CacheError(f"dataset_cache_dir: cannot lock {cache_dir / f'{key}.lock'} ({exc.strerror or exc}); "
                             "use a directory on a file system with locks") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _build(spec, tokenizer, cache_dir: Path, key: str, inputs: dict[str, Any], images=None) -> None:
    import datasets

    for stale in cache_dir.glob(f".tmp-{key}-*"):  # a killed builder's: no builder of this key runs now
        if (stale / BUILDING).is_file():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = cache_dir / f".tmp-{key}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        (tmp / BUILDING).touch()
        datasets.disable_progress_bars()  # the rank's log is read by people; the events say what happens
        parts = max(1, spec.dataset_num_proc)
        built = datasets.Dataset.from_generator(
            _encoded, features=_features(), cache_dir=str(tmp / "build"), num_proc=parts if parts > 1 else None,
            # `datasets` splits every list among the processes: only `parts` is one.
            fingerprint=key, gen_kwargs={
                "parts": list(range(parts)), "n_parts": parts, "entries": tuple(spec.dataset),
                "tokenizer": tokenizer, "max_length": spec.max_length, "seed": spec.seed,
                "max_record_bytes": spec.max_record_bytes,
                "persona": images.persona(spec) if images is not None else Persona.of(spec),
                "images": images, "strict": spec.strict})
        error = _first_error(built)
        if error is not None:
            write_json_atomic(cache_dir / f"{key}.failed.json", {"error": error, "inputs": inputs})
            raise DataError(error)
        _write_tokens(built.data.table.select(COLUMNS), tmp / TOKENS)
        skipped = _skips(built)
        del built
        shutil.rmtree(tmp / "build")
        write_json_atomic(tmp / MARKER, {"inputs": inputs, "created": time.time(), "skipped": skipped})
        (tmp / BUILDING).unlink()
        os.rename(tmp, cache_dir / key)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CacheError(f"dataset_cache_dir: writing the tokenized data to {cache_dir} failed "
                         f"({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _encoded(parts: list[int], n_parts: int, entries: tuple[str, ...], tokenizer, max_length: int, seed: int,
             max_record_bytes: int, persona: Persona, images=None, strict: bool = True) -> Iterator[dict[str, Any]]:
    """Rows of the records of `parts` (each the records whose position % n_parts is the part). A
    bad record ends its part with a row that holds the error: an exception raised here would reach
    the builder's caller without its message when it crossed from a worker process. Not `strict`: a
    record that cannot be encoded (its images decoded whole first, its videos' sampled frames after) is a
    skipped row, and the part
    goes on; a file that cannot be read still ends it."""
    empty = {"input_ids": [], "labels": [], "rejected_input_ids": [], "rejected_labels": [], "images": []}
    for part in parts:
        source, position = 0, -1
        try:
            for source, entry in enumerate(entries):
                position = -1
                for position, record in positioned_records(parse_source(entry), part, n_parts, seed, max_record_bytes):
                    try:
                        sample = encode_checked(record, tokenizer, max_length, persona, images, strict)
                    except Exception as exc:  # a chat template's raise_exception (roles out of turn) too
                        failure = exc if isinstance(exc, DataError) else DataError(
                            f"{record.where}: {type(exc).__name__}: {exc}")
                        if strict or isinstance(exc, ReaderMissing):  # not the record's fault: no skip
                            raise failure from None
                        yield {**empty, "length": SKIPPED, "source": source, "position": position, "error": None,
                               "skipped": str(failure)}
                        continue
                    chosen, rejected = (sample.chosen, sample.rejected) if isinstance(sample, Pair) else (sample, None)
                    ids, labels = (chosen.input_ids, chosen.labels) if chosen is not None else ([], [])
                    yield {"input_ids": ids, "labels": labels, "length": len(sample) if sample else 0, "source": source,
                           "position": position, "rejected_input_ids": rejected.input_ids if rejected else [],
                           "rejected_labels": rejected.labels if rejected else [],
                           "images": chosen.images if chosen is not None else [], "error": None, "skipped": None}
        except DataError as exc:
            yield {**empty, "length": 0, "source": source, "position": position + 1, "error": str(exc), "skipped": None}


def _write_tokens(table, path: Path) -> None:
    """One Arrow IPC file, written a record batch at a time (bounded memory), that `_open` maps."""
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)


def _features():
    from datasets import Features, Sequence, Value

    return Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                     "length": Value("int32"), "source": Value("int32"), "position": Value("int64"),
                     "rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int32")),
                     "images": Sequence(Value("string")), "error": Value("string"), "skipped": Value("string")})


def _first_error(built) -> str | None:
    """The message of the earliest bad record (by dataset, then position), or None."""
    found = _earliest(built, "error", 1)
    return found[0] if found else None


def _skips(built) -> dict[str, Any]:
    """How many records were skipped, and the messages of the first NAMED_SKIPS."""
    skipped = built.data.column("skipped")
    return {"count": len(skipped) - skipped.null_count, "first": _earliest(built, "skipped", NAMED_SKIPS)}


def _earliest(built, column: str, count: int) -> list[str]:
    """The first `count` values of a message column that are set, by dataset, then position."""
    messages = built.data.column(column)
    if messages.null_count == len(messages):
        return []
    import pyarrow.compute as pc

    rows = np.nonzero(pc.is_valid(messages).to_numpy(zero_copy_only=False))[0]
    source = built.data.column("source").to_numpy()[rows]
    position = built.data.column("position").to_numpy()[rows]
    return [messages[int(rows[i])].as_py() for i in np.lexsort((position, source))[:count]]


def _read_failure(path: Path) -> str:
    try:
        return str(json.loads(path.read_text())["error"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"dataset_cache_dir: {path} cannot be read ({exc}); remove it to tokenize again") from None


