"""Data loading: formats, sharding, response-only labels, truncation and bad records."""
from __future__ import annotations

import csv
import json

import pytest

from backend.job.spec import JobSpec
from launcher.data import (IGNORE, Batches, DataError, Record, Sample, encode, one_per_row, parse_source,
                           read_records, to_messages)
from launcher.tokenized import open_tokenized
from worker import ROOT, events, run_worker, write_run

LIMIT = JobSpec(model="m", dataset=["d"]).max_record_bytes  # the job's default bound on a record

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "content": "2 + 3 = 5"}, {"role": "user", "content": "And 2 * 3?"},
                     {"role": "assistant", "content": "2 * 3 = 6"}]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")


def load_samples(entries, tokenizer, max_length, rank, world, cache):
    """A rank's samples as the worker reads them: tokenized into the cache, then its shard."""
    tokenized = open_tokenized(JobSpec(model="m", dataset=entries, max_length=max_length), tokenizer, cache)
    rows, dropped = tokenized.shard(rank, world)
    return tokenized.samples(rows), dropped


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_formats_become_messages():
    alpaca = to_messages(Record("f:1", {"instruction": "Add", "input": "2 3", "output": "5", "system": "S"}))[0]
    assert alpaca == [{"role": "system", "content": "S"}, {"role": "user", "content": "Add\n2 3"},
                      {"role": "assistant", "content": "5"}]
    assert to_messages(Record("f:1", {"query": "q", "response": "r"}))[0][1] == {"role": "assistant", "content": "r"}
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert to_messages(Record("f:1", sharegpt))[0][1] == {"role": "assistant", "content": "yo"}
    assert to_messages(Record("f:1", {"text": "plain"})) == (None, "plain")


def test_the_jobs_system_prompt_and_names_fill_every_record(tokenizer):
    """ms-swift's --system, --model_name and --model_author: a conversation without a system message
    gets the job's; {{NAME}} and {{AUTHOR}} take the first name in Chinese text, else the second."""
    from backend.job.records import Persona

    persona = Persona.of(JobSpec(model="m", dataset=["d"], system="Be brief.", model_name=["小黄", "Xiao Huang"],
                                 model_author=["魔搭", "ModelScope"]))
    en = Record("d.jsonl:1", {"query": "Who are you?", "response": "I am {{NAME}}, trained by {{AUTHOR}}."})
    assert to_messages(en, persona)[0] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Xiao Huang, trained by ModelScope."}]
    zh = Record("d.jsonl:2", {"query": "你是谁？", "response": "我是{{NAME}}，由{{AUTHOR}}训练。"})
    assert to_messages(zh, persona)[0][2]["content"] == "我是小黄，由魔搭训练。"
    assert to_messages(Record("f:1", CHAT), persona)[0] == CHAT["messages"]  # its own system prompt stays
    # The record's own language picks the name, not a Chinese name filled in before it.
    mixed = Persona(name=("小黄",), author=("魔搭", "ModelScope"))
    assert to_messages(en, mixed)[0][1]["content"] == "I am 小黄, trained by ModelScope."
    one = Persona(name=("Swifty",), author=("swift-studio",))
    assert to_messages(zh, one)[0][1]["content"] == "我是Swifty，由swift-studio训练。"
    assert to_messages(Record("f:3", {"text": "{{NAME}} here"}), one) == (None, "Swifty here")
    with pytest.raises(DataError, match=r"^d\.jsonl:1: the record says \{\{NAME\}\}; set model_name"):
        to_messages(en, Persona())
    # The worker trains on what the fill-in gives.
    sample = encode(en, tokenizer, max_length=512, persona=persona)
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_loss_only_on_assistant_tokens(tokenizer):
    sample = encode(Record("f:1", CHAT), tokenizer, max_length=512)
    learned = tokenizer.decode([t for t, l in zip(sample.input_ids, sample.labels) if l != IGNORE])
    assert learned == "2 + 3 = 5<|im_end|>\n2 * 3 = 6<|im_end|>\n"
    assert len(sample.input_ids) == len(sample.labels)
    text = encode(Record("f:1", {"text": "1 + 1 = 2"}), tokenizer, max_length=512)
    assert text.labels == text.input_ids and text.input_ids[-1] == tokenizer.eos_token_id


def test_truncation_and_samples_without_response_left(tokenizer):
    full = encode(Record("f:1", CHAT), tokenizer, max_length=512)
    first_answer = next(i for i, label in enumerate(full.labels) if label != IGNORE)
    cut = encode(Record("f:1", CHAT), tokenizer, max_length=first_answer + 3)
    assert cut.input_ids == full.input_ids[:first_answer + 3] and cut.labels == full.labels[:first_answer + 3]
    # Truncated before the first answer: nothing to learn, dropped (not an error).
    assert encode(Record("f:1", CHAT), tokenizer, max_length=first_answer) is None


def test_every_file_type_and_rank_shards(tmp_path, tokenizer):
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(10)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["query", "response"])
        writer.writeheader()
        writer.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.csv", "d.parquet"):
        shards = [[r.data["query"] for r in read_records(parse_source(str(tmp_path / name)), rank, 3, 0, LIMIT)]
                  for rank in range(3)]
        assert sorted(sum(shards, [])) == sorted(r["query"] for r in rows), name
        assert [len(s) for s in shards] == [4, 3, 3] and not set(shards[0]) & set(shards[1])
    limited = list(read_records(parse_source(f"{jsonl}#4"), 0, 1, 7, LIMIT))
    assert len(limited) == 4 and limited == list(read_records(parse_source(f"{jsonl}#4"), 0, 1, 7, LIMIT))
    samples, dropped = load_samples([str(jsonl)], tokenizer, 64, rank=1, world=2, cache=tmp_path / "cache")
    assert len(samples) == 5 and dropped == 0


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "message 1 needs a 'role'"),
    ('{"prompt": "a", "completion": "b"}', "unknown record format with fields ['completion', 'prompt']"),
    ('[1, 2]', "expected an object with fields"),
    ('{"text": ""}', "'text' must be a non-empty string"),
    # ms-swift's multimodal records (LLaMA-Factory's too): their text alone would train the tags as text
    ('{"messages": [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A cat"}], '
     '"images": ["cat.png"]}', "a multimodal record ('images'): the model is not a vision-language model"),
    ('{"conversations": [{"from": "human", "value": "<video>Go on"}, {"from": "gpt", "value": "ok"}], '
     '"videos": ["a.mp4"]}', "a multimodal record ('videos')"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": '
     '{"url": "x"}}]}, {"role": "assistant", "content": "A cat"}]}',
     "message 1's content is a list of parts (image_url, text): give its text as a string"),
])
def test_bad_record_names_file_and_line(tmp_path, tokenizer, line, message):
    good = {"query": "q", "response": "r"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, line, good])
    with pytest.raises(DataError) as err:
        load_samples([str(path)], tokenizer, 64, rank=0, world=2, cache=tmp_path / "cache")
    assert str(err.value).startswith(f"{path}:3: ") and message in str(err.value)


def test_a_rank_parses_only_its_own_lines(tmp_path):
    """The reader behind each tokenizing process parses only the lines of its part."""
    good = json.dumps({"query": "q", "response": "r"})
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, "{broken", good])  # record 2: part 0 of 2
    with pytest.raises(DataError, match=":3: invalid JSON"):
        list(read_records(parse_source(str(path)), 0, 2, 0, LIMIT))
    assert len(list(read_records(parse_source(str(path)), 1, 2, 0, LIMIT))) == 2


def test_bad_sources(tmp_path, tokenizer):
    with pytest.raises(DataError, match="not found"):
        load_samples([str(tmp_path / "missing.jsonl")], tokenizer, 64, 0, 1, cache=tmp_path / "cache")
    with pytest.raises(DataError, match="positive sample count"):
        parse_source("org/name#many")


def test_batches_of_a_step_do_not_depend_on_the_steps_asked_before():
    """A resumed run starts a fresh Batches at its step; it must see what the uninterrupted run saw."""
    samples = [Sample([i, i + 1], [i, i + 1]) for i in range(12)]

    def batches():
        return Batches(lambda members: [samples[i] for i in members], one_per_row(len(samples)), micro_batch=2,
                       accumulation=2, steps_per_epoch=3, seed=7, pad_id=0, packed=False, max_length=8)

    def ids(b, step):
        return [batch["input_ids"].tolist() for batch, _, _ in b.step(step)]

    running = batches()
    in_order = [ids(running, step) for step in range(9)]
    assert [ids(batches(), step) for step in range(9)] == in_order
    assert [ids(running, step) for step in (7, 1, 4, 0)] == [in_order[7], in_order[1], in_order[4], in_order[0]]
    assert in_order[0] != in_order[3]  # a new epoch, a new order


@pytest.mark.e2e
def test_padding_free_micro_batches_train_as_padded_ones(tokenizer, tiny_model):
    """padding_free: a micro-batch's samples end to end in one row (positions restarting, no mask)
    give the padded micro-batch's loss and gradients: no sample attends to or predicts from another."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.data import micro_batch, padded_row

    records = read_records(parse_source(str(ROOT / "assets" / "demo" / "train.jsonl") + "#6"), 0, 1, 0, LIMIT)
    rows = [padded_row(encode(r, tokenizer, 64)) for r in records]
    padded, tokens, samples = micro_batch(rows, tokenizer.pad_token_id, False, 64)
    flat, flat_tokens, flat_samples = micro_batch(rows, tokenizer.pad_token_id, False, 64, flat=True)
    assert flat["input_ids"].shape == (1, tokens) and "attention_mask" not in flat
    assert (flat_tokens, flat_samples) == (tokens, samples) == (sum(len(r.input_ids) for r in rows), 6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    # as the worker loads it: transformers reads packed positions only where no cache is kept
    model.config.use_cache = False
    grads = []
    for batch in (padded, flat):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_bad_record_in_other_rank_shard_stops_all_ranks_before_training(tmp_path, tiny_model):
    rows = [json.dumps({"query": f"q{i}", "response": f"r{i}"}) for i in range(40)]
    rows[13] = '{"query": "q13", "response": '  # line 14, record 13 → rank 1's shard
    data = tmp_path / "train.jsonl"
    write_jsonl(data, rows)
    run = write_run(tmp_path / "run", model=str(tiny_model), dataset=[str(data)], max_length=32, max_steps=5)
    proc = run_worker(run, timeout=180)
    assert proc.returncode != 0
    assert f"{data}:14: invalid JSON" in proc.log
    assert "Traceback" not in proc.log.split(f"{data}:14")[0].splitlines()[-1]
    end, = events(run, 0, "end")
    assert end["status"] == "failed" and end["step"] == 0 and f"{data}:14" in end["error"]
    assert not events(run, 0, "train") and not list(run.glob("checkpoint-*"))


@pytest.mark.e2e
def test_the_worker_refuses_a_line_past_max_record_mib_by_file_and_line(tmp_path):
    """Past the lines validate samples, a line longer than max_record_mib fails the run with the
    worker's own message naming file:line, not an out-of-memory kill blamed on a peer."""
    good = json.dumps({"query": "What is 2 + 2?", "response": "4"})
    path = write_jsonl(tmp_path / "data.jsonl", [good] * 300 + ['{"query": "' + "x" * (3 << 20) + '"}'] + [good] * 10)
    run = write_run(tmp_path / "run", model=str(ROOT / "assets" / "demo" / "model"), dataset=[str(path)],
                    max_record_mib=1.0, max_length=32, max_steps=2, torch_dtype="float32")
    proc = run_worker(run, nproc=1, timeout=180)
    assert proc.returncode != 0
    assert f"DataError: {path}:301: a record of more than 1 MiB" in proc.log, proc.log[-3000:]
