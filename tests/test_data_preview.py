"""The Train tab's data preview: the worker's own tokenization of the first records (loss tokens
marked), lengths against max_length, packing fill and counts; made by a process of its own; drawn
escaped (records are anyone's text)."""
from __future__ import annotations

import json

import pytest

from backend.job.demo import demo_spec
from backend.job.records import Persona, parse_source, read_records
from backend.runs.preview import PreviewError, data_preview
from launcher.data import encode
from launcher.preview import preview
from studio.preview_view import lengths_figure, preview_html
from worker import ROOT

DEMO = ROOT / "assets" / "demo"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO / "model")


def test_the_preview_counts_what_the_worker_keeps_and_marks_its_loss_tokens(tmp_path, tokenizer):
    long = tmp_path / "long.jsonl"
    rows = [{"query": "word " * n, "response": f"answer {n}"} for n in (2, 20, 40, 60)]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = demo_spec().model_copy(update={"dataset": [str(DEMO / "self_cognition.jsonl") + "#7", str(long)],
                                          "max_length": 48})
    result = preview(spec, tokenizer)
    cognition, words = result["datasets"]
    assert (cognition["count"], cognition["measured"], words["count"], words["measured"]) == (7, 7, 4, 4)
    # the worker's own judgement, record by record
    records = list(read_records(parse_source(str(long)), 0, 1, spec.seed, spec.max_record_bytes))
    kept = [encode(r, tokenizer, 48, Persona.of(spec)) for r in records]
    whole = [encode(r, tokenizer, 1 << 30, Persona.of(spec)) for r in records]
    assert words["lengths"] == [len(s.input_ids) for s in whole]
    assert words["truncated"] == sum(len(s.input_ids) > 48 for s in whole) >= 2
    assert words["dropped"] == sum(s is None for s in kept) >= 1
    assert len(words["samples"]) == 4 - words["dropped"]
    # the first records as training sees them: the prompt without loss, the answer (with the name
    # the job gives) and its end-of-turn token with it
    for sample in cognition["samples"]:
        assert f"{DEMO / 'self_cognition.jsonl'}:" in sample["where"]
        loss = "".join(text for text, trained in sample["segments"] if trained)
        prompt = "".join(text for text, trained in sample["segments"] if not trained)
        assert "Swifty" in loss and loss.endswith("<|im_end|>\n") and "<|im_start|>" not in loss, loss
        assert prompt.startswith("<|im_start|>user\n") and "{{NAME}}" not in prompt + loss
    assert 0 < result["row_fill"] <= result["packed_fill"] <= 1
    # streamed: the file's first records (as training reads them), the file not counted
    streamed, = preview(spec.model_copy(update={"streaming": True, "dataset": [str(long)]}), tokenizer)["datasets"]
    assert streamed["count"] is None and streamed["lengths"] == words["lengths"]


def test_the_preview_process_names_what_it_cannot_read(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "response": "a"}\n{"nope": 1}\n')
    result = data_preview(demo_spec().model_copy(update={"dataset": [str(bad), str(DEMO / "train.jsonl") + "#5"]}))
    broken, fine = result["datasets"]
    assert broken["error"].startswith(f"{bad}:2: unknown record format") and fine["error"] is None
    assert fine["count"] == 5 and len(fine["samples"]) == 3
    with pytest.raises(PreviewError, match=f"model: cannot load a tokenizer from '{tmp_path}'"):
        data_preview(demo_spec().model_copy(update={"model": str(tmp_path)}))


def test_the_preview_is_drawn_escaped():
    result = {"max_length": 64, "packing": False, "row_fill": 0.5, "packed_fill": 0.8, "datasets": [
        {"entry": "/data/x.jsonl", "count": 2, "measured": 2, "truncated": 1, "dropped": 0, "lengths": [10, 70],
         "error": None, "samples": [{"where": "/data/x.jsonl:1", "tokens": 10,
                                     "segments": [["<script>alert(1)</script> ", False], ["<b>ok</b>", True]]}]},
        {"entry": "org/set", "count": None, "measured": 0, "truncated": 0, "dropped": 0, "lengths": [],
         "error": "org/set[3]: <img src=x onerror=alert(1)>", "samples": []}]}
    page = preview_html(result)
    assert "<script>" not in page and "<img" not in page and "<b>ok</b>" not in page
    assert '<mark class="loss">&lt;b&gt;ok&lt;/b&gt;</mark>' in page and "&lt;script&gt;" in page
    assert "x.jsonl</b>: 2 records; of the first 2: 1 longer than max_length 64" in page
    assert "one sample per row fills 50% of them; packing would fill 80% (packing is off)" in page
    figure = lengths_figure(result)
    assert [list(t.x) for t in figure.data] == [[10, 70]]
