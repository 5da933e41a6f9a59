"""Streamed training data (`streaming: true`): each data-parallel rank reads every n-th record as
training asks, tokenized as the cache would, packed on the fly; a checkpoint keeps each rank's
position, so a resume trains on the next records (none twice, none skipped); data that ends
before max_steps ends the run naming it, after a checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest

from backend.job.records import DataError, parse_source, read_records
from backend.job.spec import JobSpec
from backend.job.validate import validate
from launcher import stream as streaming
from launcher.data import Persona, encode
from launcher.stream import StreamBatches, load_position, open_stream, save_position
from worker import ROOT, events, losses, preference_pairs, run_worker, write_run

DEMO = str(ROOT / "assets" / "demo" / "train.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")


def chats(path, count: int, start: int = 0):
    """`count` chats, each its own numbers, so each record's tokens say which record it was."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]}) + "\n"
                            for i in range(start, start + count)))
    return str(path)


def job(dataset, **extra) -> JobSpec:
    return JobSpec(model="m", dataset=dataset, streaming=True, max_steps=10, max_length=64, **extra)


def drawn(batches: StreamBatches, steps: range) -> list[tuple[int, ...]]:
    """The token rows each step trained on, padding cut off, in order."""
    out = []
    for step in steps:
        micro = batches.step(step)
        assert micro is not None, batches.error
        for batch, _, _ in micro:
            for ids, keep in zip(batch["input_ids"].tolist(), batch.get("attention_mask", batch["input_ids"] * 0 + 1).tolist()):
                out.append(tuple(t for t, k in zip(ids, keep) if k))
    return out


def test_the_ranks_share_the_records_in_file_order_tokenized_as_the_cache_does(tmp_path, tokenizer, monkeypatch):
    spec = job([DEMO + "#30", chats(tmp_path / "c.jsonl", 9)])
    persona = Persona.of(spec)
    expected = [encode(r, tokenizer, 64, persona) for entry in (DEMO + "#30", str(tmp_path / "c.jsonl"))
                for r in list(read_records(parse_source(entry.split("#")[0]), 0, 1, 0, spec.max_record_bytes))
                [:30 if "#" in entry else None]]
    tokenized = []
    original = streaming.encode_checked
    monkeypatch.setattr(streaming, "encode_checked",
                        lambda record, *a: tokenized.append(record.where) or original(record, *a))
    shares = [list(open_stream(spec, tokenizer, rank, 3)) for rank in range(3)]
    # every third record to each rank (`#30`: the first 30 of the file, then the other file's 9)
    for rank, share in enumerate(shares):
        assert [(row["input_ids"], row["labels"]) for row in share] == \
            [(s.input_ids, s.labels) for s in expected[rank::3]]
        assert all(row["error"] is None for row in share)
    # datasets maps every record before its split drops the other ranks' (pinned: the reason
    # open_stream passes over them itself); each rank tokenized only its own
    assert len(tokenized) == len(expected) == 39


@pytest.mark.parametrize("packing", [False, True])
def test_a_restored_position_continues_with_the_next_records(tmp_path, tokenizer, packing):
    spec = job([chats(tmp_path / "c.jsonl", 200)])

    def batches():
        return StreamBatches(open_stream(spec, tokenizer, 1, 2), 2, 2, 2, tokenizer.pad_token_id, packing, 64)

    straight, rows, before = batches(), [], {}
    for step in range(6):
        before[step] = len(rows)
        rows += drawn(straight, range(step, step + 1))
        if step in (1, 4):  # as the trainer saves: its next step's data already fetched
            (tmp_path / str(step)).mkdir()
            save_position(straight, step, tmp_path / str(step), rank=1)
    for step in (1, 4):
        again = batches()
        load_position(again, step, tmp_path / str(step), rank=1)
        assert drawn(again, range(step, 6)) == rows[before[step]:]
    if not packing:  # one record a row: the rows are the rank's records, each once, in order
        assert len(set(rows)) == len(rows) == 24
    # the next step after a restore must be the restored one
    with pytest.raises(RuntimeError, match="expected 6"):
        again.step(7)
    # the last step's checkpoint (max_steps: nothing fetched after it) keeps the stream as it stands
    (tmp_path / "6").mkdir()
    save_position(straight, 6, tmp_path / "6", rank=1)
    last = batches()
    load_position(last, 6, tmp_path / "6", rank=1)
    assert drawn(last, range(6, 7)) == drawn(straight, range(6, 7))


def test_preference_pairs_stream_as_the_cache_makes_their_micro_batches(tmp_path, tokenizer):
    """A DPO job's pairs streamed: each micro-batch is its pairs' chosen rows then their rejected
    rows, tokenized as the cache's encoder does; a position kept with pairs waiting in its buffer
    continues with the same rows."""
    from launcher.data import Batches, one_per_row

    spec = job([preference_pairs(tmp_path / "p.jsonl", 60)], rlhf_type="dpo")
    persona = Persona.of(spec)
    pairs = [encode(r, tokenizer, 64, persona) for r in read_records(parse_source(str(tmp_path / "p.jsonl")), 1, 2, 0,
                                                                     spec.max_record_bytes)]
    stream = StreamBatches(open_stream(spec, tokenizer, 1, 2), 2, 3, 2, tokenizer.pad_token_id, False, 64)
    cache = Batches(lambda members: [pairs[i] for i in members], one_per_row(len(pairs)), 3, 2, 1, 0,
                    tokenizer.pad_token_id, False, 64, pairs=True)
    for step in range(3):
        got = stream.step(step)
        for micro, (batch, tokens, samples) in enumerate(got):
            expected = cache.batch_of(list(range((2 * step + micro) * 3, (2 * step + micro + 1) * 3)))
            assert {k: v.tolist() for k, v in batch.items()} == {k: v.tolist() for k, v in expected[0].items()}
            assert (tokens, samples) == expected[1:] and batch["input_ids"].shape[0] == 6
    stream.buffer.append(pairs[0])  # a pair waiting when step 3 takes its data (and keeps its position)
    got = stream.step(3)
    assert got[0][0]["input_ids"][0].tolist()[:len(pairs[0].chosen)] == pairs[0].chosen.input_ids
    save_position(stream, 3, tmp_path, rank=1)
    again = StreamBatches(open_stream(spec, tokenizer, 1, 2), 2, 3, 2, tokenizer.pad_token_id, False, 64)
    load_position(again, 3, tmp_path, rank=1)
    assert [{k: v.tolist() for k, v in b.items()} for b, _, _ in again.step(3)] == \
        [{k: v.tolist() for k, v in b.items()} for b, _, _ in got]


def test_bad_data_and_damaged_positions_are_named(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(chats(tmp_path / "c.jsonl", 6)).read() + "{not json\n" + "x" * 3000 + "\n")
    batches = StreamBatches(open_stream(job([str(bad)]), tokenizer, 0, 1), 1, 2, 1, tokenizer.pad_token_id, False, 64)
    assert batches.step(0) and batches.step(1) and batches.step(2)
    assert batches.step(3) is None and batches.error.startswith(f"{bad}:7: invalid JSON")
    long = StreamBatches(open_stream(job([str(bad)], max_record_mib=0.001), tokenizer, 1, 2), 1, 1, 1, 0, False, 64)
    assert [long.step(s) is not None for s in range(4)] == [True, True, True, False]
    assert long.error.startswith(f"{bad}:8: a record of more than")
    ended = StreamBatches(open_stream(job([chats(tmp_path / "d.jsonl", 3)]), tokenizer, 0, 1), 1, 2, 1, 0, False, 64)
    assert ended.step(0) and ended.step(1) is None and ended.error is None and ended.records == 3

    straight = StreamBatches(open_stream(job([str(bad)]), tokenizer, 0, 2), 2, 1, 1, 0, False, 64)
    straight.step(0)
    save_position(straight, 0, tmp_path, rank=0)
    other = StreamBatches(open_stream(job([str(bad)]), tokenizer, 0, 4), 4, 1, 1, 0, False, 64)
    with pytest.raises(DataError, match="streamed its data over 2 data-parallel ranks and this job has 4"):
        load_position(other, 0, tmp_path, rank=0)
    with pytest.raises(DataError, match="holds no stream position for rank 1"):
        load_position(other, 0, tmp_path, rank=1)
    for crafted in ('["a list"]', '{"dp_size": 2, "stream": 5, "records": 0, "dropped": 0, "buffer": []}',
                    '{"dp_size": 2, "stream": {}, "records": 0, "dropped": 0, "buffer": [["x", []]]}', "{",
                    # a buffered sample's images must be paths (or inline images), nothing else
                    '{"dp_size": 2, "stream": {}, "records": 0, "dropped": 0, "buffer": [[[1], [1], [], [], [7]]]}'):
        (tmp_path / "data-rank0.json").write_text(crafted)
        with pytest.raises(DataError, match=f"resume: {tmp_path / 'data-rank0.json'}"):
            load_position(StreamBatches(open_stream(job([str(bad)]), tokenizer, 0, 2), 2, 1, 1, 0, False, 64),
                          0, tmp_path, rank=0)


def test_strict_off_skips_a_streamed_record_it_cannot_encode_counts_it_and_keeps_the_count(tmp_path, tokenizer):
    path = tmp_path / "some-bad.jsonl"
    good = open(chats(tmp_path / "c.jsonl", 6)).read().splitlines()
    path.write_text("\n".join(good[:2] + ['{"prompt": "p"}'] + good[2:4] + ['{"messages": 5}'] + good[4:]) + "\n")
    loose = job([str(path)], strict=False)
    batches = StreamBatches(open_stream(loose, tokenizer, 0, 1), 1, 2, 1, tokenizer.pad_token_id, False, 64)
    rows = drawn(batches, range(3))  # the six good records, none lost
    strict = StreamBatches(open_stream(job([chats(tmp_path / "only.jsonl", 6)]), tokenizer, 0, 1), 1, 2, 1,
                           tokenizer.pad_token_id, False, 64)
    assert rows == drawn(strict, range(3))
    assert batches.skipped == 2 and batches.records == 8
    assert [m.split(": ")[0] for m in batches.skipped_first] == [f"{path}:3", f"{path}:6"]
    # a checkpoint's position keeps the count; one written before skipping existed restores none
    save_position(batches, 3, tmp_path, rank=0)  # after the three steps
    again = StreamBatches(open_stream(loose, tokenizer, 0, 1), 1, 2, 1, tokenizer.pad_token_id, False, 64)
    load_position(again, 3, tmp_path, rank=0)
    assert (again.skipped, again.skipped_first) == (2, batches.skipped_first)
    old = json.loads((tmp_path / "data-rank0.json").read_text())
    del old["skipped"], old["skipped_first"]
    (tmp_path / "data-rank0.json").write_text(json.dumps(old))
    load_position(again, 3, tmp_path, rank=0)
    assert again.skipped == 0
    (tmp_path / "data-rank0.json").write_text(json.dumps({**old, "skipped": 1, "skipped_first": "a string"}))
    with pytest.raises(DataError, match="is not a stream position .*skipped_first is not a list of messages"):
        load_position(again, 3, tmp_path, rank=0)
    # strict on stops at the first; a line that is not JSON stops either way
    stopped = StreamBatches(open_stream(job([str(path)]), tokenizer, 0, 1), 1, 2, 1, tokenizer.pad_token_id, False, 64)
    assert stopped.step(0) and stopped.step(1) is None and stopped.error.startswith(f"{path}:3: ")
    path.write_text("\n".join(good[:2] + ["{not json"] + good[2:]) + "\n")
    broken = StreamBatches(open_stream(loose, tokenizer, 0, 1), 1, 2, 1, tokenizer.pad_token_id, False, 64)
    assert broken.step(0) and broken.step(1) is None and broken.error.startswith(f"{path}:3: invalid JSON")


def test_streaming_needs_max_steps_and_a_validation_file():
    problems = {(p.field, p.severity): p.message for p in validate(
        JobSpec(model="m", dataset=[DEMO, str(ROOT / "assets" / "demo" / "x.json")], streaming=True,
                split_dataset_ratio=0.1, dataset_num_proc=2))}
    assert "give max_steps" in problems["max_steps", "error"]
    assert "give val_dataset" in problems["split_dataset_ratio", "error"]
    assert "ignored with streaming" in problems["dataset_num_proc", "warning"]
    assert "read whole even when streamed" in problems["dataset[1]", "warning"]
    assert not [p for p in validate(JobSpec(model="m", dataset=[DEMO], streaming=True, max_steps=5))
                if p.field in ("max_steps", "split_dataset_ratio", "dataset[0]")]


@pytest.mark.e2e
def test_a_streamed_run_resumes_at_its_position_and_ends_with_its_data(tmp_path, tiny_model):
    """Two ranks, packed rows, a validation file, strict off and a record that cannot be encoded:
    the data ends before max_steps, the run stops naming it with a checkpoint of the steps it
    trained, having counted the record it skipped; a resume from an earlier checkpoint trains the
    same steps with the same losses (the same records) and ends at the same place."""
    data = chats(tmp_path / "c.jsonl", 60)
    lines = open(data).read().splitlines()
    open(data, "w").write("\n".join(lines[:11] + ['{"prompt": "p"}'] + lines[11:]) + "\n")
    spec = dict(model=str(tiny_model), dataset=[data], streaming=True, packing=True, strict=False,
                val_dataset=[chats(tmp_path / "v.jsonl", 8, start=1000)], eval_steps=3, max_steps=40, max_length=64,
                per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1,
                save_steps=3, save_total_limit=None, torch_dtype="float32", lora_dropout=0.0)
    first = write_run(tmp_path / "first", **spec)
    proc = run_worker(first)
    assert proc.returncode != 0
    trained = losses(first)
    end = max(trained)
    assert 4 <= end < 40 and sorted(trained) == list(range(1, end + 1)), proc.log[-3000:]
    (error,) = [e for e in events(first, 0, "end") if e.get("error")] or [None]
    message = error["error"] if error else proc.log
    assert f"the data ended at step {end} of max_steps=40" in message and "c.jsonl" in message, message
    assert (first / f"checkpoint-{end}").is_dir() and json.loads((first / f"checkpoint-{end}" / "data-rank1.json").read_text())
    assert sorted(e["step"] for e in events(first, 0, "eval")) == list(range(3, end + 1, 3))
    # the rank that read it says so, with the count over both ranks
    skips = [e for rank in (0, 1) for e in events(first, rank, "data") if e.get("skipped")]
    assert [e["skipped"] for e in skips] == [1] and skips[0]["skipped_first"][0].startswith(f"{data}:12: ")

    resumed = write_run(tmp_path / "resumed", **spec)
    shutil.copytree(first / "checkpoint-3", resumed / "checkpoint-3")
    proc = run_worker(resumed, resume="latest")
    again = losses(resumed)
    assert proc.returncode != 0 and sorted(again) == list(range(4, end + 1)), proc.log[-3000:]
    for step, loss in again.items():
        assert loss == pytest.approx(trained[step], rel=2e-4), step
