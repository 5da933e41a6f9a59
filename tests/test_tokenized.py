"""The tokenized-data cache (launcher.tokenized): the same token ids, labels and order as the encoder
rank by rank, one tokenization per set of inputs, never a stale or torn entry, errors named."""
from __future__ import annotations

import bisect
import json
import os
import random
import threading

import numpy as np
import pytest

from backend.job.spec import JobSpec
from launcher import tokenized as cache
from launcher.data import DataError, Persona, encode, pack_plan, parse_source, read_records
from launcher.tokenized import BUILDING, MARKER, CacheError, open_tokenized
from worker import ROOT

DEMO = [str(ROOT / "assets" / "demo" / "self_cognition.jsonl"), str(ROOT / "assets" / "demo" / "train.jsonl") + "#600"]
CHATS = [  # multi-turn, with system prompts; long ones lose their last answers to max_length, some all of them
    {"messages": [{"role": "system", "content": "Be brief."}]
     + [m for i in range(turns) for m in ({"role": "user", "content": f"What is {i} + {turns}?"},
                                          {"role": "assistant", "content": f"{i} + {turns} = {i + turns}"})]}
    for turns in range(1, 9)] + [{"messages": [{"role": "user", "content": "word " * 80},
                                               {"role": "assistant", "content": "too late"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")


def job(dataset, **extra) -> JobSpec:
    return JobSpec(model="m", dataset=dataset, model_name=["Swifty"], model_author=["swift-studio"], **extra)


def encoder_shard(spec: JobSpec, tokenizer, rank: int, world: int) -> tuple[list[tuple], int]:
    """What each rank read and tokenized itself before the cache: its records of each dataset in turn."""
    kept, dropped = [], 0
    for entry in spec.dataset:
        for record in read_records(parse_source(entry), rank, world, spec.seed, spec.max_record_bytes):
            sample = encode(record, tokenizer, spec.max_length, Persona.of(spec))
            if sample is None:
                dropped += 1
            else:
                kept.append((sample.input_ids, sample.labels))
    return kept, dropped


@pytest.mark.parametrize("num_proc", [1, 2])
def test_the_cache_gives_every_rank_the_encoders_tokens_labels_and_order(tmp_path, tokenizer, num_proc):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS * 3))
    spec = job([*DEMO, str(chats)], max_length=48, dataset_num_proc=num_proc)
    data = open_tokenized(spec, tokenizer, tmp_path / "cache")
    assert data.built and data.table.num_rows == 500 + 600 + 3 * len(CHATS)
    for world in (1, 2, 3):
        for rank in range(world):
            rows, dropped = data.shard(rank, world)
            expected, expected_dropped = encoder_shard(spec, tokenizer, rank, world)
            assert [(s.input_ids, s.labels) for s in data.samples(rows)] == expected
            assert dropped == expected_dropped and list(data.lengths(rows)) == [len(ids) for ids, _ in expected]
    assert sum(data.shard(rank, 2)[1] for rank in range(2)) >= 3  # the long prompt leaves no answer: counted


def test_a_second_open_reads_the_entry_and_a_changed_file_is_tokenized_again(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"query": f"q{i}", "response": f"r{i}"}) + "\n" for i in range(20)))
    spec = job([str(path)], max_length=32)
    first = open_tokenized(spec, tokenizer, tmp_path / "cache")
    again = open_tokenized(spec, tokenizer, tmp_path / "cache")
    assert first.built and not again.built and again.entry == first.entry
    # The same size, another answer, and a modification time set back: the bytes hashed tell.
    stat = path.stat()
    path.write_text(path.read_text().replace("r7", "r8"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = open_tokenized(spec, tokenizer, tmp_path / "cache")
    assert changed.built and changed.entry != first.entry and (first.entry / MARKER).is_file()
    assert changed.samples(changed.shard(0, 1)[0]) != first.samples(first.shard(0, 1)[0])
    # What an entry depends on beyond the files: max_length, the tokenizer, the job's names.
    for other in (job([str(path)], max_length=31), job([str(path)], max_length=32, system="Be brief.")):
        assert open_tokenized(other, tokenizer, tmp_path / "cache").entry != changed.entry
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template + " ")
    assert cache.cache_key(spec, tokenizer)[0] != changed.entry.name


def test_processes_that_need_the_same_entry_at_once_tokenize_it_once(tmp_path, tokenizer, monkeypatch):
    """The ranks of a run (and other runs) wait on the entry's lock: one builds, all read its result."""
    builds = []
    real = cache._build

    def counted(*args):
        builds.append(threading.get_ident())
        return real(*args)
    monkeypatch.setattr(cache, "_build", counted)
    spec = job(DEMO, max_length=48)
    results = [None] * 3

    def open_it(i):
        results[i] = open_tokenized(spec, tokenizer, tmp_path / "cache")
    threads = [threading.Thread(target=open_it, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and [r.built for r in results].count(True) == 1
    assert len({r.entry for r in results}) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([results[0].entry.name,
                                                                             results[0].entry.name + ".lock"])


def test_a_bad_record_is_named_once_and_kept_as_the_entrys_failure(tmp_path, tokenizer, monkeypatch):
    rows = [json.dumps({"query": f"q{i}", "response": f"r{i}"}) for i in range(40)]
    rows[13], rows[30] = '{"query": "q13", "response": ', '{"text": ""}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    spec = job([str(path)], max_length=32, dataset_num_proc=2)  # the error crosses from a worker process
    with pytest.raises(DataError, match=rf"^{path}:14: invalid JSON"):
        open_tokenized(spec, tokenizer, tmp_path / "cache")
    monkeypatch.setattr(cache, "_build", lambda *a: pytest.fail("tokenized again"))
    with pytest.raises(DataError, match=rf"^{path}:14: invalid JSON"):
        open_tokenized(spec, tokenizer, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # no entry, no leftover


def test_strict_off_skips_a_record_the_chat_template_refuses_and_strict_on_names_it(tmp_path, tokenizer):
    """A chat template's raise_exception (roles out of turn, as Llama's and Mistral's templates do) is a
    record's failure like any other: skipped and named with strict off, the run stopped by file:line
    with it on; the held-out split never draws a skipped record."""
    import copy

    strict_template = copy.deepcopy(tokenizer)
    strict_template.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    turns = lambda *roles: {"messages": [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]}  # noqa: E731
    rows = [turns("user", "assistant")] * 6
    rows[2] = turns("user", "user", "assistant")
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = job([str(path)], max_length=64)
    with pytest.raises(DataError, match=rf"^{path}:3: TemplateError: roles must alternate user/assistant$"):
        open_tokenized(spec, strict_template, tmp_path / "cache")
    loose = open_tokenized(spec.model_copy(update={"strict": False}), strict_template, tmp_path / "cache")
    assert (loose.skipped, loose.skipped_first) == (1, (f"{path}:3: TemplateError: roles must alternate user/assistant",))
    assert len(loose.shard(0, 1)[0]) == 5
    for seed in range(20):
        assert not loose.held_out(0.5, seed)[2]  # the skipped record's row


def test_cache_directory_errors_are_named_and_nothing_foreign_is_removed(tmp_path, tokenizer):
    spec = job(DEMO[:1], max_length=32)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CacheError, match=f"dataset_cache_dir: cannot write to {tmp_path / 'a-file' / 'cache'}"):
        open_tokenized(spec, tokenizer, tmp_path / "a-file" / "cache")
    key, _ = cache.cache_key(spec, tokenizer)
    root = tmp_path / "cache"
    killed = root / f".tmp-{key}-dead"  # a killed builder's half-written entry
    killed.mkdir(parents=True)
    (killed / BUILDING).touch()
    foreign = root / f".tmp-{key}-mine"  # named like one, but not made by a builder
    foreign.mkdir()
    data = open_tokenized(spec, tokenizer, root)
    assert data.built and not killed.exists() and foreign.is_dir()
    # A damaged entry is named, with what to do, and left as it is.
    arrow = data.entry / cache.TOKENS
    arrow.write_bytes(b"not arrow")
    with pytest.raises(CacheError, match=f"the tokenized data in {data.entry} cannot be read .*remove that directory"):
        open_tokenized(spec, tokenizer, root)
    assert arrow.read_bytes() == b"not arrow"


@pytest.mark.parametrize("craft", ["length as text", "position as float", "a missing length", "a column more"])
def test_a_crafted_arrow_file_is_named_not_read(tmp_path, tokenizer, craft):
    """An entry whose tokens.arrow is valid Arrow of another shape: the ranks read its numbers from
    the raw buffers, so a type or a missing value they do not expect must be refused, not misread."""
    import pyarrow as pa

    spec = job(DEMO[:1], max_length=32)
    data = open_tokenized(spec, tokenizer, tmp_path)
    table = data.table
    length = table.column("length")
    if craft == "length as text":
        table = table.set_column(2, "length", length.cast(pa.string()))
    elif craft == "position as float":
        table = table.set_column(4, "position", table.column("position").cast(pa.float64()))
    elif craft == "a missing length":
        table = table.set_column(2, "length", pa.array([None] + length.to_pylist()[1:], pa.int32()))
    else:
        table = table.append_column("extra", length)
    arrow = data.entry / cache.TOKENS
    arrow.unlink()  # the open table maps the old file: write a new one, not over it
    cache._write_tokens(table, arrow)
    with pytest.raises(CacheError, match=f"the tokenized data in {data.entry} cannot be read"):
        open_tokenized(spec, tokenizer, tmp_path)


def test_a_rank_reading_the_cache_imports_neither_datasets_nor_pandas(tmp_path, tokenizer):
    """pyarrow's to_numpy imports pandas (0.45 s of every rank's start with pyarrow 26); the ranks
    read the cache's numbers from its buffers instead, sliced chunks included."""
    import subprocess
    import sys

    import pyarrow as pa

    column = pa.chunked_array([pa.array(range(10), pa.int64()).slice(3, 4), pa.array([7, 8], pa.int64())])
    assert list(cache._numbers(column)) == [3, 4, 5, 6, 7, 8]
    spec = job(DEMO[:1], max_length=32)
    open_tokenized(spec, tokenizer, tmp_path)
    probe = f"""
import sys
from pathlib import Path
from transformers import AutoTokenizer
from backend.job.spec import JobSpec
from launcher.tokenized import open_tokenized
spec = JobSpec(model="m", dataset={DEMO[:1]!r}, model_name=["Swifty"], model_author=["swift-studio"], max_length=32)
data = open_tokenized(spec, AutoTokenizer.from_pretrained({str(ROOT / "assets" / "demo" / "model")!r}), Path({str(tmp_path)!r}))
rows, dropped = data.shard(0, 2)
assert not data.built and len(data.samples(rows)) == len(rows) > 0 and len(data.lengths(rows)) == len(rows)
print(sorted(m for m in ("pandas", "datasets") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    # pyarrow still imports pandas in to_numpy: when a release stops, _numbers can go
    pinned = subprocess.run([sys.executable, "-c", "import sys, pyarrow as pa; pa.array([1]).to_numpy(); print('pandas' in sys.modules)"],
                            capture_output=True, text=True)
    assert pinned.stdout.strip() == "True", pinned.stderr[-2000:]


def _reference_pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """The best-fit decreasing packing the worker has always done, on a sorted list of (free, row)."""
    members: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(room, (lengths[index], -1))
        if at == len(room):
            members.append([index])
            free, row = max_length - lengths[index], len(members) - 1
        else:
            free, row = room.pop(at)
            members[row].append(index)
            free -= lengths[index]
        if free > 0:
            bisect.insort(room, (free, row))
    return [sorted(m) for m in members]


def test_packing_on_lengths_makes_the_rows_it_always_made():
    rng = random.Random(3)
    for max_length, lengths in ((64, [rng.randint(1, 64) for _ in range(3000)]),
                                (2048, [rng.randint(50, 2048) for _ in range(2000)]),
                                (16, [16, 1, 15, 8, 8, 8, 4, 4, 2])):
        plan = pack_plan(np.array(lengths), max_length)
        assert [plan.row(i).tolist() for i in range(len(plan))] == _reference_pack(lengths, max_length)


def test_the_held_out_split_is_seeded_and_apart_from_the_training_rows(tmp_path, tokenizer):
    data = open_tokenized(job(DEMO[:1], max_length=48), tokenizer, tmp_path / "cache")
    held = data.held_out(0.1, seed=42)
    assert held.sum() == 50 and (held == data.held_out(0.1, seed=42)).all() and not (held == data.held_out(0.1, 7)).all()
    assert data.held_out(0.0001, 42).sum() == 1  # at least one record
    for world in (1, 2):
        train = np.concatenate([data.shard(r, world, ~held)[0] for r in range(world)])
        val = np.concatenate([data.shard(r, world, held)[0] for r in range(world)])
        assert not set(train) & set(val) and len(train) + len(val) == 500
