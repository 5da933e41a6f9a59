"""The `swift-studio` CLI: validate, plan, import; every user mistake is one line and exit 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from backend.cli import main

ROOT = Path(__file__).resolve().parent.parent
JOB = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": ["swift/self-cognition#500"], "deepspeed": "zero2",
       "nnodes": 2, "nproc_per_node": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
       "output_dir": "/shared/output"}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "hosts").write_text("node-a slots=4 addr=10.1.0.1\nnode-b slots=4 ssh_user=ubuntu\n")
    return tmp_path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_ok(files, capsys):
    code, out, err = run(capsys, "validate", files / "job.yaml", "--hostfile", files / "hosts")
    assert code == 0 and err == ""
    assert out == "ok: 2 node(s) x 4 proc = world 8: DP=8 TP=1 PP=1 CP=1 EP=1 SP=1\n"


def test_validate_reports_each_problem(files, capsys):
    bad = {**JOB, "nproc_per_node": 8, "context_parallel_size": 3, "max_length": 1000}
    (files / "bad.yaml").write_text(yaml.safe_dump(bad))
    code, out, err = run(capsys, "validate", files / "bad.yaml", "--hostfile", files / "hosts")
    lines = err.splitlines()
    assert code == 1 and out == ""
    assert f"{files / 'bad.yaml'}: nproc_per_node: 8 processes per node, but node-a has 4 slot(s) (GPUs)" in lines
    assert f"{files / 'bad.yaml'}: max_length: 1000 is not divisible by CP=3" in lines
    assert all(line.startswith(str(files / "bad.yaml")) or line.startswith("warning: ") for line in lines)


@pytest.mark.parametrize("write,expected", [
    (None, "{f}: file not found"),
    ("model: m\ndataset: [d]\nlora_rnak: 8\n", "{f}: lora_rnak: unknown field (did you mean 'lora_rank'?)"),
    ("model: m\ndataset: [d]\nnnodes: two\n", "{f}: nnodes: input should be a valid integer, unable to parse string as an integer (got 'two')"),
    ("model: m\n  dataset: [d\n", "{f}:2: invalid YAML"),
    ("model: m\ndataset: [d]\ndeepspeed: /nonexistent/ds.json\n", "{f}: deepspeed: /nonexistent/ds.json: DeepSpeed config not found"),
])
def test_bad_job_files(files, capsys, write, expected):
    path = files / "case.yaml"
    if write is not None:
        path.write_text(write)
    code, out, err = run(capsys, "validate", path, "--hostfile", files / "hosts")
    assert code == 1 and out == ""
    assert err.splitlines()[0].startswith(expected.format(f=path))
    assert "Traceback" not in err


def test_unreadable_deepspeed_json(files, capsys):
    (files / "ds.json").write_text('{"zero_optimization": {"stage": 2}\n,,}')
    (files / "job.yaml").write_text(yaml.safe_dump({**JOB, "deepspeed": str(files / "ds.json")}))
    code, _, err = run(capsys, "validate", files / "job.yaml", "--hostfile", files / "hosts")
    assert code == 1 and err == f"{files / 'job.yaml'}: deepspeed: {files / 'ds.json'}:2: DeepSpeed config is not valid JSON: Expecting property name enclosed in double quotes\n"


def test_malformed_hostfile(files, capsys):
    (files / "hosts").write_text("node-a slots=4\nnode-b slots=four\nnode-a slots=4\n")
    code, _, err = run(capsys, "validate", files / "job.yaml", "--hostfile", files / "hosts")
    assert code == 1
    assert err.splitlines() == [f"{files / 'hosts'}:2: expected 'hostname slots=N [key=value ...]', got 'node-b slots=four'",
                                f"{files / 'hosts'}:3: duplicate host 'node-a' (first on line 1)"]


def test_usage_mistake_is_one_line(capsys):
    code, _, err = run(capsys, "validate", "--hostfil", "x")
    assert code == 1 and err.startswith("swift-studio validate: ") and len(err.splitlines()) == 1


def test_plan_json(files, capsys):
    code, out, _ = run(capsys, "plan", files / "job.yaml", "--hostfile", files / "hosts", "--json", "--run-id", "r1",
                       "--run-dir", files / "runs" / "r1", "--master-port", "29777")
    assert code == 0
    data = json.loads(out)
    assert data["layout"]["world"] == 8 and data["ds_config"]["train_batch_size"] == 2 * 2 * 8
    assert [n["host"] for n in data["nodes"]] == ["node-a", "node-b"]
    assert "--rdzv_endpoint" in data["nodes"][1]["argv"] and "10.1.0.1:29777" in data["nodes"][1]["argv"]
    assert data["nodes"][0]["env"]["SWIFT_STUDIO_RUN_ID"] == "r1"
    memory = data["memory"]
    assert memory["total_gib"] > memory["parameters_gib"] > 0 and memory["total_params"] == 494032768
    assert data["run_dir"] == str(files / "runs" / "r1")


def test_plan_text(files, capsys):
    code, out, _ = run(capsys, "plan", files / "job.yaml", "--hostfile", files / "hosts")
    assert code == 0 and "# node 1: node-b" in out and "-m torch.distributed.run" in out and "train_batch_size 32" in out


def test_import_then_validate(files, capsys):
    command = ("NPROC_PER_NODE=4 NNODES=2 swift sft --model Qwen/Qwen2.5-7B-Instruct --train_type lora "
               "--dataset 'swift/self-cognition#500' --deepspeed zero2 --system 'You are a helpful assistant.' "
               "--dataloader_num_workers 4")
    code, out, err = run(capsys, "import", command, "-o", files / "imported.yaml")
    assert code == 0 and "warning: --dataloader_num_workers 4" in err
    text = (files / "imported.yaml").read_text()
    assert text.startswith("# ignored: --dataloader_num_workers") and "system: You are a helpful assistant." in text
    code, out, _ = run(capsys, "validate", files / "imported.yaml", "--hostfile", files / "hosts")
    assert code == 0 and out.startswith("ok: 2 node(s) x 4 proc")


def test_import_bad_command(capsys):
    code, out, err = run(capsys, "import", "python train.py --lr 1")
    assert code == 1 and err.startswith("command: no 'swift sft'")
    code, _, err = run(capsys, "import", "swift sft --model m --lora_rank eight")
    assert code == 1 and "dataset: required" in err and "lora_rank:" in err


def test_a_job_files_inputs_are_read_from_its_directory(tmp_path, monkeypatch, capsys):
    """The bundled demo job validates from any directory; a job file's relative inputs are read from
    its own directory where it holds them, anything else (hub ids, paths from the current directory,
    the outputs) as written."""
    from backend.job.spec import load_spec
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(capsys, "validate", ROOT / "assets" / "demo" / "job.yaml")
    assert code == 0 and out.startswith("ok: 1 node(s) x 2 proc"), err
    jobs = tmp_path / "jobs"
    (jobs / "data").mkdir(parents=True)
    (jobs / "data" / "a.jsonl").write_text('{"query": "q", "response": "r"}\n')
    (jobs / "ds.json").write_text("{}")
    (elsewhere / "here.jsonl").write_text('{"query": "q", "response": "r"}\n')
    (jobs / "job.yaml").write_text(yaml.safe_dump({
        "model": "Qwen/Qwen2.5-0.5B", "dataset": ["data/a.jsonl#1", "here.jsonl", "swift/self-cognition#5"],
        "val_dataset": ["data/a.jsonl"], "deepspeed": "ds.json", "output_dir": "out"}))
    spec, problems = load_spec(Path("..") / "jobs" / "job.yaml")
    assert problems == []
    assert spec.dataset == [f"{jobs}/data/a.jsonl#1", "here.jsonl", "swift/self-cognition#5"]
    assert (spec.val_dataset, spec.deepspeed) == ([f"{jobs}/data/a.jsonl"], f"{jobs}/ds.json")
    assert (spec.model, spec.output_dir) == ("Qwen/Qwen2.5-0.5B", "out")
    # keywords stay keywords, whatever the job's directory holds
    (jobs / "zero2").mkdir()
    (jobs / "latest").mkdir()
    (jobs / "kw.yaml").write_text(yaml.safe_dump({"model": "m", "dataset": ["d"], "deepspeed": "zero2",
                                                  "resume_from_checkpoint": "latest"}))
    spec, _ = load_spec(jobs / "kw.yaml")
    assert (spec.deepspeed, spec.resume_from_checkpoint) == ("zero2", "latest")


def test_console_script_in_a_real_process(files):
    """`python -m backend.cli` from another directory: exit codes and output as a user sees them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "backend.cli", "validate", "job.yaml", "--hostfile", "hosts"],
                        cwd=files, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 2 node(s) x 4 proc"), ok.stderr
    (files / "typo.yaml").write_text("model: m\ndataset: [d]\nmax_lenght: 10\n")
    bad = subprocess.run([sys.executable, "-m", "backend.cli", "validate", "typo.yaml"],
                         cwd=files, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr == "typo.yaml: max_lenght: unknown field (did you mean 'max_length'?)\n"
    # A run command's refusal (raised in backend.runcli) is one line too, not a traceback.
    missing = subprocess.run([sys.executable, "-m", "backend.cli", "status", "no-such-run"], cwd=files,
                             env={**env, "HOME": str(files)}, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stderr == "no run 'no-such-run'\n", missing.stderr


@pytest.mark.e2e
def test_control_characters_from_files_and_names_are_printed_escaped(tmp_path):
    """A dataset file named to clear the terminal (ESC [2J), retitle it (OSC 0) and reverse the
    line (U+202E): the names reach `validate`, a run's failure and its cause; `swift-studio`
    prints each control character as its escape, as `git` and `ls` do."""
    from backend.job.cluster import GpuInfo, local_cluster
    from backend.job.spec import JobSpec
    from backend.runs.manager import RunManager

    evil = "evil\x1b[2J\x1b]0;pwned\x07\u202egnp.jsonl"
    data = tmp_path / evil
    data.write_text('{"query": "q", "response": "r"}\n\x1b[31m\n')
    spec = JobSpec(model=str(ROOT / "assets" / "demo" / "model"), dataset=[str(data)], nproc_per_node=1,
                   output_dir=str(tmp_path / "out"))
    (tmp_path / "job.yaml").write_text(spec.to_yaml())
    url = f"sqlite:///{tmp_path / 'studio.db'}"
    with RunManager(url) as m:
        run_id = m.launch(spec, local_cluster(GpuInfo()), name="n\x1b[2J")
        assert m.wait(run_id, timeout=120).state == "failed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    escaped = "evil\\x1b[2J\\x1b]0;pwned\\x07\\u202egnp.jsonl"
    for argv in (["validate", "job.yaml"], ["status", run_id, "--db", url], ["runs", "--db", url],
                 ["import", f"swift sft --model m --dataset {data}"]):
        done = subprocess.run([sys.executable, "-m", "backend.cli", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        printed = done.stdout + done.stderr
        assert not any(c in printed for c in "\x1b\x07\u202e"), (argv, printed)
        assert escaped in printed or argv[0] in ("runs", "import"), (argv, printed)  # YAML quotes its own
        assert "Traceback" not in printed, printed


def test_escape_controls_keeps_text_and_layout():
    from backend.cli import escape_controls

    assert escape_controls("a\tb\nc é 日本 ✓") == "a\tb\nc é 日本 ✓"
    assert escape_controls("\x1b[2J\r\x00\x7f\x9b\u2066") == "\\x1b[2J\\r\\x00\\x7f\\x9b\\u2066"


def test_a_database_file_that_is_not_one_is_named_and_left_untouched(tmp_path, capsys):
    """A corrupt file gave a 124-line traceback naming no file; an empty one was silently made a
    new database (now it is said)."""
    cases = {"garbage.db": b"this is not a database at all\n" * 10, "pages.db": b"SQLite format 3\x00" + b"\xff" * 4000}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        for argv in (["runs"], ["alerts", "some-run"]):
            code, out, err = run(capsys, *argv, "--db", f"sqlite:///{path}")
            assert code == 1 and out == "" and len(err.splitlines()) == 1, (name, argv, err)
            assert err.startswith(f"database {path}") or err.startswith(f"database sqlite:///{path}"), err
            assert "left untouched" in err and "Traceback" not in err
        assert path.read_bytes() == content
    empty = tmp_path / "empty.db"
    empty.touch()
    done = subprocess.run([sys.executable, "-m", "backend.cli", "runs", "--db", f"sqlite:///{empty}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "no runs yet\n"), done.stderr
    assert f"database {empty} was an empty file: a new database is made in it" in done.stderr


def test_processes_making_one_new_database_at_once_all_open_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'new' / 'studio.db'}"
    code = ("import sys; from backend.store.db import make_engine, create_db_and_tables; "
            "create_db_and_tables(make_engine(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    assert [(p.wait(timeout=120), p.stderr.read()) for p in procs] == [(0, "")] * 4
    assert sorted(p.name for p in (tmp_path / "new").iterdir() if not p.name.startswith("studio.db")) == []
    assert (tmp_path / "new" / "studio.db").stat().st_mode & 0o777 == 0o600
