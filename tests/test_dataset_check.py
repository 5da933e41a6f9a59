"""Datasets are checked before launch: a bounded sample of each local file, with file:line messages."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from backend.job.records import SAMPLE_HEAD, DataError, parse_source, read_records, sample_problems
from backend.job.spec import JobSpec
from backend.job.validate import errors, validate
from worker import ROOT

LIMIT = JobSpec(model="m", dataset=["d"]).max_record_bytes  # the job's default bound on a record

GOOD = {"query": "What is 2 + 2?", "response": "4"}


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def job(tmp_path, dataset: str) -> JobSpec:
    return JobSpec(model=str(ROOT / "assets" / "demo" / "model"), dataset=[dataset], output_dir=str(tmp_path / "runs"),
                   nproc_per_node=1)


def test_a_malformed_line_is_named_with_file_and_line(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD] * 6 + ['{"query": "q", "response": '] + [GOOD] * 3)
    (problem,) = sample_problems(str(path), LIMIT)
    assert problem.startswith(f"{path}:7: invalid JSON")


def test_records_without_the_expected_fields(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "p", "completion": "c"}, {"messages": []}])
    problems = sample_problems(str(path), LIMIT)
    assert problems[0].startswith(f"{path}:2: unknown record format with fields ['completion', 'prompt']")
    assert problems[1] == f"{path}:3: 'messages' must be a non-empty list"


def test_empty_and_blank_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    assert sample_problems(str(empty), LIMIT) == [f"{empty}: the file is empty (no records)"]
    assert sample_problems(str(blank), LIMIT) == [f"{blank}: no records (only blank lines)"]


def test_a_binary_file_is_named(tmp_path):
    path = tmp_path / "weights.jsonl"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    assert sample_problems(str(path), LIMIT) == [
        f"{path}: not a text file (binary data at byte 4); expected JSON lines, JSON, CSV or parquet"]
    fake = tmp_path / "fake.parquet"
    fake.write_text(json.dumps(GOOD) + "\n")
    assert sample_problems(str(fake), LIMIT) == [f"{fake}: not a parquet file (it does not start with the PAR1 magic bytes)"]


def test_random_offsets_reach_past_the_head_with_exact_line_numbers(tmp_path):
    rows = [GOOD] * (SAMPLE_HEAD + 50) + [{"wrong": i} for i in range(400)]
    path = jsonl(tmp_path / "big.jsonl", rows)
    problems = sample_problems(str(path), LIMIT)
    assert problems, "the bad second half of the file was not sampled"
    line = int(problems[0].split(":")[1])
    assert line > SAMPLE_HEAD + 50 and json.loads(path.read_text().splitlines()[line - 1]) == {"wrong": line - SAMPLE_HEAD - 51}
    assert problems[-1].endswith("checked") and len(problems) == 4  # three named, then a count


def test_csv_json_and_parquet_files(tmp_path):
    table = tmp_path / "d.csv"
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, ["instruction", "answer"])
        writer.writeheader()
        writer.writerow({"instruction": "i", "answer": "a"})
    assert sample_problems(str(table), LIMIT)[0].startswith(f"{table}:2: unknown record format with fields ['answer', 'instruction']")
    whole = tmp_path / "d.json"
    whole.write_text('[{"query": "q", "response": "r"},\n {"query": "q"]\n')
    assert sample_problems(str(whole), LIMIT)[0].startswith(f"{whole}:2: dataset is not valid JSON")
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 3), good)
    assert sample_problems(str(good), LIMIT) == []
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(good.read_bytes()[:40])
    assert sample_problems(str(truncated), LIMIT)[0].startswith(f"{truncated}: cannot read parquet")


def test_a_file_fixed_in_place_is_checked_again(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", ["{oops"])
    assert sample_problems(str(path), LIMIT)
    jsonl(path, [GOOD, GOOD])
    assert sample_problems(str(path), LIMIT) == []


def test_strict_off_turns_bad_records_into_a_warning_but_not_a_file_of_them(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD] * 5 + [{"prompt": "p"}] + [GOOD] * 2 + ['{"query": "q", "response": '])
    some_bad = jsonl(tmp_path / "some.jsonl", [GOOD] * 5 + [{"prompt": "p"}] + [GOOD] * 2)
    loose = job(tmp_path, str(some_bad)).model_copy(update={"strict": False})
    found = [p for p in validate(loose) if p.field == "dataset[0]"]
    assert [p.severity for p in found] == ["warning"] and found[0].message.startswith(
        f"strict is off: records like these are skipped and counted: {some_bad}:6: ")
    assert [p.field for p in errors(validate(job(tmp_path, str(some_bad))))] == ["dataset[0]"]  # strict on
    # a line that is not JSON stops any run
    assert errors([p for p in validate(loose.model_copy(update={"dataset": [str(path)]})) if p.field == "dataset[0]"])
    # a stream skips them too; a file of nothing but bad records is no data to skip in
    streamed = loose.model_copy(update={"streaming": True, "max_steps": 5})
    assert not [p for p in errors(validate(streamed)) if p.field.startswith("dataset") or p.field == "strict"]
    all_bad = jsonl(tmp_path / "bad.jsonl", [{"prompt": "p"}] * 4)
    assert {p.field for p in errors(validate(loose.model_copy(update={"dataset": [str(all_bad)]})))} == {"dataset[0]"}


def test_validate_names_the_dataset_field(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD, "not json"])
    problems = [p for p in errors(validate(job(tmp_path, f"{path}#50"))) if p.field.startswith("dataset")]
    assert [(p.field, p.message) for p in problems] == [
        ("dataset[0]", f"{path}:2: invalid JSON (Expecting value at column 1)")]
    assert not [p for p in validate(job(tmp_path, str(ROOT / "assets" / "demo" / "train.jsonl")))
                if p.field.startswith("dataset")]


@pytest.mark.e2e
def test_cli_validate_refuses_a_bad_dataset_before_launch(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [GOOD] * 3 + [{"conversations": [{"from": "human", "value": "hi"}]}])
    spec = job(tmp_path, str(data))
    (tmp_path / "job.yaml").write_text(spec.to_yaml())
    res = subprocess.run([sys.executable, "-m", "backend.cli", "validate", str(tmp_path / "job.yaml")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode != 0
    assert f"dataset[0]: {data}:4: no assistant message, nothing to learn from" in res.stdout + res.stderr


def test_a_fifo_device_directory_or_link_loop_as_dataset_is_named_before_launch(tmp_path):
    """They validated `ok` and failed 14 s after launch as "not found" (a FIFO would block the
    reader for ever). Each is named for what it is, by validate and by the worker's reader."""
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    expected = {"fifo.jsonl": "is a FIFO (named pipe): reading it would wait for a writer",
                "dir.jsonl": "is a directory", "loop.jsonl": "is a symbolic link loop",
                "dangling.jsonl": f"is a symbolic link to {tmp_path / 'gone.jsonl'}, which does not exist"}
    for name, what in expected.items():
        path = tmp_path / name
        problems = [(p.field, p.message) for p in errors(validate(job(tmp_path, str(path)))) if p.field.startswith("dataset")]
        assert problems == [("dataset[0]", f"{path} {what}, not a data file")], name
        with pytest.raises(DataError, match=re.escape(f"dataset file {path} {what}")):
            next(read_records(parse_source(str(path)), 0, 1, 0, LIMIT))
    problems = [(p.field, p.message) for p in errors(validate(job(tmp_path, "/dev/zero"))) if p.field.startswith("dataset")]
    assert problems == [("dataset[0]", "/dev/zero is a character device, not a data file")]
    missing = tmp_path / "missing.jsonl"
    assert [(p.field, p.message) for p in errors(validate(job(tmp_path, str(missing))))
            if p.field.startswith("dataset")] == [("dataset[0]", f"file not found: {missing}")]
    # A relative path says where it was looked for.
    assert [(p.field, p.message) for p in errors(validate(job(tmp_path, "data/missing.jsonl")))
            if p.field.startswith("dataset")] == [
        ("dataset[0]", f"file not found: data/missing.jsonl (a relative path is read from the job file's directory, "
                       f"else from the current directory, {os.getcwd()})")]


def test_a_huge_line_is_named_before_launch_without_being_read_whole(tmp_path):
    """A 200 MB single-record JSON-lines file passed validate and grew a rank to 22 GB. Past
    max_record_mib a line is refused by file:line, read a chunk at a time."""
    import tracemalloc

    path = tmp_path / "huge.jsonl"
    with path.open("w") as f:
        f.write(json.dumps(GOOD) + "\n")
        f.write('{"query": "' + "x" * (48 << 20) + '", "response": "r"}\n')
        f.write(json.dumps(GOOD) + "\n")
    spec = job(tmp_path, str(path)).model_copy(update={"max_record_mib": 1.0})
    tracemalloc.start()
    problems = [(p.field, p.message) for p in errors(validate(spec)) if p.field.startswith("dataset")]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert problems == [("dataset[0]", f"{path}:2: a record of more than 1 MiB; raise max_record_mib if it is "
                                       "meant to be one record (a record is read and tokenized whole)")]
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB held to check a 48 MiB line"
    with pytest.raises(DataError, match=re.escape(f"{path}:2: a record of more than 1 MiB")):
        list(read_records(parse_source(str(path)), 0, 1, 0, 1 << 20))
    assert not errors(validate(job(tmp_path, str(path)).model_copy(update={"max_record_mib": 64.0})))


def test_a_record_naming_the_model_needs_its_name_before_launch(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [GOOD, {"query": "Who made you?", "response": "{{AUTHOR}} did."}])
    spec = job(tmp_path, str(path))
    assert [(p.field, p.message) for p in errors(validate(spec))] == [
        ("dataset[0]", f"{path}:2: the record says {{{{AUTHOR}}}}; set model_author to the name it stands for")]
    assert errors(validate(spec.model_copy(update={"model_author": ["swift-studio"]}))) == []
