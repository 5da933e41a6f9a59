"""Chat through the RunManager with the real worker: a tiny LoRA run and a tiny full run trained on
this machine, then chat sessions on their node (local) that stream tokens from the base and the
fine-tuned model. The fine-tuned answers are checked against what launcher.export's merged model
generates greedily for the same prompt, the base answers against the base model's. Then what goes
wrong: no checkpoint, damaged files, a checkpoint moved away while loaded, a prompt longer than the
model's positions, a worker killed mid-answer, a manager closed with sessions open."""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from backend.job.cluster import GpuInfo, local_cluster
from backend.job.spec import JobSpec
from backend.runs.chat import ChatError
from backend.runs.manager import RunManager
from worker import ROOT, unloadable_model, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#128"
TOKENS = 32  # launcher.export's sample length


def job(model: Path, out: Path, **extra) -> JobSpec:
    return JobSpec(model=str(model), dataset=[DATA], output_dir=str(out), nproc_per_node=1, max_steps=6, save_steps=3,
                   logging_steps=3, torch_dtype="float32", max_length=64, gradient_checkpointing=False,
                   per_device_train_batch_size=4, learning_rate=1e-2, lora_dropout=0.0, env={"OMP_NUM_THREADS": "1"},
                   **extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    """A RunManager with a LoRA run and a full run (checkpoints at steps 3 and 6), and a run whose
    model cannot be loaded (failed before any checkpoint). Tests read these and change only copies."""
    root = tmp_path_factory.mktemp("chat")
    broken = unloadable_model(tiny_model, root / "broken-model")
    with RunManager(f"sqlite:///{root / 'studio.db'}") as m:
        runs = {"lora": m.launch(job(tiny_model, root / "out", train_type="lora"), local_cluster(GpuInfo())),
                "full": m.launch(job(tiny_model, root / "out", train_type="full"), local_cluster(GpuInfo())),
                "broken": m.launch(job(broken, root / "out"), local_cluster(GpuInfo()))}
        # A run that has not ended trains on the GPUs a chat worker would load its model onto.
        with pytest.raises(ChatError, match=rf"run {runs['lora']} is \w+: a chat worker would load its model"):
            m.chat_open(runs["lora"])
        for kind, run_id in runs.items():
            run = m.wait(run_id, timeout=300)
            assert run.state == ("failed" if kind == "broken" else "succeeded"), (kind, run.message, run.log_tail)
        until(lambda: len(m.checkpoints(runs["lora"])) == 2 and len(m.checkpoints(runs["full"])) == 2, timeout=30)
        yield m, runs, root


@pytest.fixture(scope="module")
def lora_export(trained) -> dict:
    """The LoRA run's export, made once for the tests that read it, whichever runs first."""
    m, runs, _ = trained
    return m.export(runs["lora"])


def answer(m: RunManager, session: str, model: str, prompt: str, tokens: int = TOKENS) -> tuple[str, list[dict]]:
    events = list(m.chat_reply(session, [(model, [{"role": "user", "content": prompt}])], tokens, 0.0))
    assert events[-1]["type"] == "done" and all(e["type"] == "token" for e in events[:-1]), events
    return "".join(e["text"] for e in events[:-1]), events


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def reference(ckpt: Path, model: str, prompt: str) -> tuple[str, str]:
    """(fine-tuned, base) greedy answers of launcher.export's models, in this process."""
    from transformers import AutoTokenizer

    from launcher.export import base_model, generate, merged_model

    tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    return (generate(merged_model(ckpt, model).eval(), tokenizer, prompt, TOKENS),
            generate(base_model(model).eval(), tokenizer, prompt, TOKENS))


def test_lora_answers_are_the_exported_models_and_the_base_differs(trained, lora_export, tiny_model):
    m, runs, _ = trained
    exported = lora_export
    prompt, sample = exported["prompt"], exported["sample"]
    session, ready = m.chat_open(runs["lora"])
    assert (ready["kind"], ready["source"], ready["node"], ready["device"], ready["dtype"]) == (
        "lora", "checkpoint", "localhost", "cpu", "float32")
    assert ready["path"].endswith("/checkpoint-6") and ready["base_from"] == "the same model with its LoRA adapter disabled"
    tuned, events = answer(m, session, "tuned", prompt)
    base, _ = answer(m, session, "base", prompt)
    assert len(events) > 2 and events[-1]["tokens"] == TOKENS  # streamed piece by piece
    assert tuned == sample
    assert base != tuned and base == reference(Path(ready["path"]), str(tiny_model), prompt)[1]
    # Both in one exchange: one batch, the base's row with the adapter off; the two answers stream at
    # once (each model's first piece comes before either is done) and are the ones asked alone.
    asked = [{"role": "user", "content": prompt}]
    events = list(m.chat_reply(session, [("base", asked), ("tuned", asked)], TOKENS, 0.0))
    first_done = next(i for i, e in enumerate(events) if e["type"] == "done")
    assert {e["model"] for e in events[:first_done] if e["type"] == "token"} == {"base", "tuned"}, events
    assert {side: "".join(e["text"] for e in events if e["model"] == side and e["type"] == "token")
            for side in ("base", "tuned")} == {"base": base, "tuned": tuned}
    m.chat_close(session)
    until(lambda: gone(ready["pid"]), timeout=15)

    # The export itself: the base is the job's model, loaded beside it.
    assert m.exported(runs["lora"]) == exported["out"]
    session, ready = m.chat_open(runs["lora"], exported["out"])
    assert (ready["source"], ready["kind"], ready["base_from"]) == ("export", "merged", str(tiny_model))
    assert answer(m, session, "tuned", prompt)[0] == sample and answer(m, session, "base", prompt)[0] == base
    m.chat_close(session)


def test_full_fine_tuning_answers_and_the_base_from_the_jobs_model(trained, tiny_model):
    m, runs, _ = trained
    assert m.exported(runs["full"]) is None
    session, ready = m.chat_open(runs["full"], "3")
    assert (ready["kind"], ready["base_from"]) == ("full", str(tiny_model)) and ready["path"].endswith("/checkpoint-3")
    prompt = "What is 2 + 3?"
    tuned, base = answer(m, session, "tuned", prompt)[0], answer(m, session, "base", prompt)[0]
    assert (tuned, base) == reference(Path(ready["path"]), str(tiny_model), prompt)
    assert tuned != base
    # Both at once (a thread each: they are two models), sampled with top-p, a system prompt first.
    asked = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
    events = list(m.chat_reply(session, [("base", asked), ("tuned", asked)], 8, 0.7, 0.9))
    done = {e["model"]: e for e in events if e["type"] == "done"}
    assert set(done) == {"base", "tuned"} and events[-1]["type"] == "done"
    assert done["tuned"]["prompt_tokens"] > answer(m, session, "tuned", prompt)[1][-1]["prompt_tokens"]
    m.chat_close(session)


def test_a_run_without_a_checkpoint_starts_nothing(trained):
    m, runs, _ = trained
    with pytest.raises(ChatError, match=rf"^run {runs['broken']} has no checkpoint yet, .*\(nothing was started\)"):
        m.chat_open(runs["broken"])
    assert not (Path(m.run(runs["broken"]).run_dir) / "logs" / "chat-localhost.log").exists()


def test_damaged_files_are_named(trained, lora_export, tmp_path):
    m, runs, _ = trained
    run_dir = Path(m.run(runs["lora"]).run_dir)
    copy = shutil.copytree(run_dir / "checkpoint-6", tmp_path / "checkpoint-6")
    adapter = copy / "model" / "adapter_model.safetensors"
    size = adapter.stat().st_size
    os.truncate(adapter, size - 100)
    with pytest.raises(ChatError, match=rf"node localhost: checkpoint {copy} does not match what was saved: "
                                        rf"checkpoint-6/model/adapter_model.safetensors: size {size - 100} != recorded"):
        m.chat_open(runs["lora"], str(copy))

    export = shutil.copytree(lora_export["out"], tmp_path / "export")
    os.truncate(export / "model.safetensors", 1000)
    with pytest.raises(ChatError, match=rf"{export}: the exported model cannot be loaded \(model.safetensors: "):
        m.chat_open(runs["lora"], str(export))


def test_a_checkpoint_moved_away_while_loaded_still_answers_and_cannot_be_loaded_again(trained, tmp_path):
    m, runs, _ = trained
    copy = shutil.copytree(Path(m.run(runs["full"]).run_dir) / "checkpoint-6", tmp_path / "checkpoint-6")
    session, _ = m.chat_open(runs["full"], str(copy))
    copy.rename(tmp_path / "moved")
    assert answer(m, session, "tuned", "Hello", 4)[1][-1]["tokens"] == 4  # the model is in memory
    m.chat_close(session)
    with pytest.raises(ChatError, match=rf"checkpoint {copy} does not exist"):
        m.chat_open(runs["full"], str(copy))


def test_a_prompt_longer_than_the_models_positions(trained):
    m, runs, _ = trained
    session, ready = m.chat_open(runs["lora"])
    assert ready["max_positions"] == 512
    with pytest.raises(ChatError, match=r"prompt: the last message alone is \d+ tokens, more than the 480 the model"):
        list(m.chat_reply(session, [("tuned", [{"role": "user", "content": "one two three " * 200}])], 32, 0.0))
    history = [{"role": role, "content": "one two three " * 20} for _ in range(6) for role in ("user", "assistant")]
    events = list(m.chat_reply(session, [("tuned", [*history, {"role": "user", "content": "Hello"}])], 32, 0.0))
    assert events[-1]["note"].startswith("left out the ") and events[-1]["prompt_tokens"] <= 480
    m.chat_close(session)


def test_a_worker_killed_mid_answer_is_reported_and_loading_again_works(trained):
    m, runs, _ = trained
    session, ready = m.chat_open(runs["lora"])
    got = []
    with pytest.raises(ChatError, match=r"node localhost: the chat worker exited before its answer was complete"):
        for event in m.chat_reply(session, [("base", [{"role": "user", "content": "Hello"}])], 400, 0.0):
            if not got:
                os.kill(ready["pid"], signal.SIGKILL)
            got.append(event)
    assert got and got[-1]["type"] == "token"
    with pytest.raises(ChatError, match="the chat session has ended"):
        m.chat_reply(session, [("base", [{"role": "user", "content": "Hello"}])], 4, 0.0)
    session, _ = m.chat_open(runs["lora"])
    assert answer(m, session, "tuned", "Hello", 4)[1][-1]["tokens"] == 4
    m.chat_close(session)


def test_a_message_sent_while_one_is_answered_is_refused(trained):
    m, runs, _ = trained
    session, ready = m.chat_open(runs["lora"])
    hello = [{"role": "user", "content": "Hello"}]
    # The exchange is pumped to its end whether read or not; the worker is paused after its first
    # token, so the answer is still being given when the second message waits its grace out.
    first = m.chat_reply(session, [("base", hello), ("tuned", hello)], 64, 0.0)
    got = [next(first)]
    os.kill(ready["pid"], signal.SIGSTOP)
    try:
        with pytest.raises(ChatError, match=r"the model is still answering the previous message"):
            list(m.chat_reply(session, [("tuned", hello)], 4, 0.0))
    finally:
        os.kill(ready["pid"], signal.SIGCONT)
    got += list(first)
    assert sorted(e["model"] for e in got if e["type"] == "done") == ["base", "tuned"] and got[-1]["type"] == "done"
    assert answer(m, session, "tuned", "Hello", 4)[1][-1]["tokens"] == 4
    m.chat_close(session)


def test_closing_the_manager_ends_its_chat_workers(trained):
    m, runs, root = trained
    other = RunManager(f"sqlite:///{root / 'studio.db'}", reattach=False)
    _, ready = other.chat_open(runs["lora"])
    assert not gone(ready["pid"])
    other.close()
    until(lambda: gone(ready["pid"]), timeout=15)
