"""ms-swift's --columns: a dataset's own column names renamed to the ones a record's format is read
by, the same for the worker, the tokenized cache, validation, the export's sample and an import."""
from __future__ import annotations

import json

import pytest

from backend.job.msswift import import_command
from backend.job.records import DataError, Persona, Record
from backend.job.spec import JobSpec, parse_spec
from backend.job.validate import validate
from launcher.data import encode
from launcher.tokenized import cache_key, open_tokenized
from studio.form import form_to_data, spec_to_form
from worker import ROOT

RENAME = {"question": "query", "answer": "response"}
ROWS = [{"question": f"What is {i} + 1?", "answer": f"{i + 1}", "id": i} for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")


@pytest.fixture
def own_columns(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_columns_parse_from_json_text_and_refuse_what_cannot_be_renamed():
    def problems(columns):
        return [(p.field, p.message) for p in parse_spec({"model": "m", "dataset": ["d.jsonl"], "columns": columns})[1]]

    assert parse_spec({"model": "m", "dataset": ["d.jsonl"], "columns": json.dumps(RENAME)})[0].columns == RENAME
    assert problems("") == [] and problems(RENAME) == []
    [(field, message)] = problems('{"question": ')
    assert field == "columns" and message.startswith("not a JSON object of old: new column names")
    assert problems('["query"]') == [("columns", "must be a JSON object of old: new column names")]
    assert problems({"q": "query", "question": "query"}) == [("columns", "two columns renamed to 'query'")]
    assert problems({"q": " "}) == [("columns", "a column name must not be empty")]


def test_a_renamed_record_trains_as_the_standard_one(tokenizer):
    persona = Persona.of(JobSpec(model="m", dataset=["d.jsonl"], columns=RENAME))
    own = Record("qa.jsonl:3", {"question": "What is 2 + 1?", "answer": "3", "id": 2})
    standard = Record("std.jsonl:3", {"query": "What is 2 + 1?", "response": "3"})
    renamed, expected = encode(own, tokenizer, 64, persona), encode(standard, tokenizer, 64)
    assert (renamed.input_ids, renamed.labels) == (expected.input_ids, expected.labels)
    with pytest.raises(DataError, match="unknown record format with fields"):
        encode(own, tokenizer, 64)  # without the renames the format is not known
    both = Record("qa.jsonl:4", {"question": "q", "query": "q again", "answer": "a"})
    with pytest.raises(DataError, match="qa.jsonl:4: columns makes both 'question' and 'query' the column 'query'"):
        encode(both, tokenizer, 64, persona)


def test_validation_reads_the_file_with_the_renames_and_names_the_line(tmp_path, own_columns):
    def data_problems(**extra):
        spec = JobSpec(model="m", dataset=[str(own_columns)], output_dir=str(tmp_path / "out"), **extra)
        return [p.message for p in validate(spec) if p.field == "dataset[0]"]

    assert data_problems(columns=RENAME) == []
    message = data_problems()[0]
    assert f"{own_columns}:1: unknown record format" in message and "the job's columns field renames" in message
    with own_columns.open("a") as f:
        f.write(json.dumps({"question": "q", "query": "q", "answer": "a"}) + "\n")
    [message] = data_problems(columns=RENAME)
    assert f"{own_columns}:41: columns makes both 'question' and 'query' the column 'query'" in message


def test_the_cache_tokenizes_with_the_renames_and_keys_on_them(tmp_path, tokenizer, own_columns):
    spec = JobSpec(model="m", dataset=[str(own_columns)], max_length=32, columns=RENAME)
    data = open_tokenized(spec, tokenizer, tmp_path / "cache")
    rows, dropped = data.shard(0, 1)
    std = [Record(f"r{i}", {"query": r["question"], "response": r["answer"]}) for i, r in enumerate(ROWS)]
    assert dropped == 0 and [(s.input_ids, s.labels) for s in data.samples(rows)] == [
        (s.input_ids, s.labels) for s in (encode(r, tokenizer, 32) for r in std)]
    other = spec.model_copy(update={"columns": {"question": "query", "answer": "response", "id": "index"}})
    assert cache_key(spec, tokenizer)[0] != cache_key(other, tokenizer)[0]


def test_an_imported_columns_flag_and_the_forms_box_keep_the_renames():
    result = import_command(f"swift sft --model m --dataset d.jsonl --columns '{json.dumps(RENAME)}'")
    spec, problems = parse_spec(result.spec)
    assert problems == [] and spec.columns == RENAME and "--columns" not in " ".join(result.ignored)
    values = spec_to_form({"columns": RENAME})
    assert values["columns"] == "question=query\nanswer=response"
    data, problems = form_to_data({"columns": values["columns"] + "\nno equals sign"})
    assert data["columns"] == RENAME and [(p.field, p.message) for p in problems] == [
        ("columns", "line 3: expected NAME=value, got 'no equals sign'")]
