"""Helpers for the worker tests: a tiny model on disk, run directories, real torchrun runs."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from forkrun import FORKSERVER_ENV, alive_fd, start_server
from sshd import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/vl.py builds the vision-language models
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def build_tiny_model(out: Path, family: str = "qwen2", **shape) -> Path:
    """The demo tokenizer with a 2-layer, 64-wide model (random, seeded) in `out`: the demo's Qwen2,
    or another transformers family (llama, mistral, qwen3, ...) of the same sizes; `shape` overrides
    TINY's sizes."""
    sys.path.insert(0, str(ROOT / "assets"))
    import torch
    from build_demo import build_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")
    tokenizer.save_pretrained(out)
    if family == "qwen2":
        model = build_model(tokenizer, seed=0, **{**TINY, **shape})
    else:
        config = AutoConfig.for_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **{**TINY, **shape})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def build_tiny_vl_model(out: Path, family: str = "qwen2_5_vl") -> Path:
    """A tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V or InternVL (2 vision blocks 32 wide, 2 language
    layers 64 wide; random, seeded) as bench/vl.py builds its shapes, its image processor limited to
    16 patches of 28 px (Qwen3-VL: 16 px patches, as its own; InternVL: 4 tiles of 56 px)."""
    from vl import build_vl_model

    patch = 16 if family == "qwen3_vl" else 14
    text = dict(**TINY, max_position_embeddings=4096)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY["hidden_size"],
                  patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":  # its tower's width is embed_dim, its hidden_size the language model's
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, embed_dim=32, hidden_size=TINY["hidden_size"], num_heads=2, mlp_ratio=2,
                      patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    elif family == "qwen2_5_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision.update(window_size=56, fullatt_block_indexes=[1])
    elif family == "qwen3_vl":
        text.update(head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        vision.update(deepstack_visual_indexes=[1], num_position_embeddings=64)
    elif family == "glm4v":  # rotary on half of each head (GLM-4.1V's partial_rotary_factor), its 3-D sections
        text.update(partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                                "partial_rotary_factor": 0.5})
        vision.update(image_size=56)
    else:  # internvl: tiles of 56 px (16 patches, 4 tokens after its pixel shuffle), a Qwen2 language model
        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=[56, 56], patch_size=[14, 14])
    # GLM-4V's processor bounds an image's pixels times its temporal patch (an image is two frames):
    # twice the bounds give it the others' sizes
    frames = 2 if family == "glm4v" else 1
    # on the CPU: the same seeded weights on every machine
    return build_vl_model(out, family, text, vision, ((2 * patch) ** 2 * 4 * frames, (2 * patch) ** 2 * 16 * frames),
                          device="cpu")


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def colour_images(directory: Path, count: int) -> str:
    """A VL data file in ms-swift's format: `count` records, each a PNG of a coloured shape (sizes
    vary) with "<image>What colour is it?" and the colour's name as the answer; the images beside
    the file, named relative to it."""
    from PIL import Image, ImageDraw

    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        name, rgb = list(COLOURS.items())[i % len(COLOURS)]
        image = Image.new("RGB", (56 + 28 * (i % 3), 56 + 14 * (i % 2)), (245, 245, 245))
        ImageDraw.Draw(image).rectangle((8, 8, 48, 40), fill=rgb)
        image.save(directory / f"{i}.png")
        lines.append(json.dumps({"messages": [{"role": "user", "content": "<image>What colour is it?"},
                                              {"role": "assistant", "content": name}], "images": [f"{i}.png"]}))
    (directory / "colours.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / "colours.jsonl")


def write_video(path: Path, rgb: tuple[int, int, int], frames: int = 8, size: tuple[int, int] = (56, 56),
                fps: int = 4) -> Path:
    """An MPEG-4 video (PyAV) of a square of colour `rgb` moving right on grey, `size` (width, height)."""
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(frames):
            image = np.full((size[1], size[0], 3), 245, dtype=np.uint8)
            image[8:40, 4 + 2 * i:36 + 2 * i] = rgb
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def colour_videos(directory: Path, count: int, images: bool = True, stem: str = "videos") -> str:
    """A VL data file in ms-swift's format with videos, `stem`.jsonl: `count` records, each an MPEG-4
    clip of a moving coloured square (8 frames at 4 a second; sizes vary) with "<video>What colour is
    it?" and the colour's name as the answer; with `images`, every third record an image of another
    colour before the video ("<image><video>Which colour moves?"), so images and videos interleave;
    files beside the data file."""
    from PIL import Image, ImageDraw

    directory.mkdir(parents=True, exist_ok=True)
    colours = list(COLOURS.items())
    lines = []
    for i in range(count):
        name, rgb = colours[i % len(colours)]
        write_video(directory / f"{i}.mp4", rgb, size=(56 + 28 * (i % 2), 56))
        record = {"messages": [{"role": "user", "content": "<video>What colour is it?"},
                               {"role": "assistant", "content": name}], "videos": [f"{i}.mp4"]}
        if images and i % 3 == 2:
            image = Image.new("RGB", (56, 56), (245, 245, 245))
            ImageDraw.Draw(image).rectangle((8, 8, 48, 40), fill=colours[(i + 1) % len(colours)][1])
            image.save(directory / f"{i}.png")
            record["messages"][0]["content"] = "<image><video>Which colour moves?"
            record["images"] = [f"{i}.png"]
        lines.append(json.dumps(record))
    (directory / f"{stem}.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / f"{stem}.jsonl")


def video_env() -> dict[str, str]:
    """The environment of a process that reads videos: transformers' video processors need
    torchvision. Where it does not import (CI: torch's CPU build, and the index holds torchvision's
    CUDA build only), the torchvision of this torch (its minor is torch's + 15) installed once under
    .cache/ with tests/cpu_torchvision's shim; {} where it imports."""
    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0:
        return {}
    import tempfile

    import torch

    minor = int(torch.__version__.split(".")[1])
    target = ROOT / ".cache" / f"torchvision-0.{minor + 15}.0"
    if not target.exists():
        target.parent.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".install-"))
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging),
                            f"torchvision==0.{minor + 15}.0"], check=True)
            staging.rename(target)
        except OSError:  # another test worker installed it first
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    path = [str(ROOT / "tests" / "cpu_torchvision"), str(target), worker_env()["PYTHONPATH"]]
    return {"PYTHONPATH": os.pathsep.join(path)}


def unloadable_model(src: Path, out: Path) -> Path:
    """A copy of the model `src` whose weights are whole but do not fit its config (the embedding
    a column wider): validation and pre-flight pass it, the worker fails loading it."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("embed_tokens.weight"))
    rows, cols = weights[name].shape
    weights[name] = np.zeros((rows, cols + 1), dtype=weights[name].dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def preference_pairs(path: Path, count: int) -> str:
    """A preference data file: arithmetic questions with the right answer chosen and an off-by-one
    answer rejected."""
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i + 1}?", "chosen": f"{2 * i + 1}",
                                        "rejected": f"{2 * i + 2}"}) + "\n" for i in range(count)))
    return str(path)


def write_run(run_dir: Path, **spec) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return run_dir


def torchrun(nproc: int, *args: str) -> list[str]:
    """torchrun on this machine with `nproc` ranks, its rendezvous on port 0: the store's own bind
    picks the port (as torchrun's --standalone does). A port picked before torchrun starts can be
    taken by then (the other test worker's runs connect and listen too), and torch's default 29500
    is shared by every run at once."""
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0",
            "--nproc_per_node", str(nproc), *args]


def torchrun_argv(run_dir: Path, nproc: int = 2, resume: str | None = None) -> list[str]:
    """The argv of docs/architecture.md ("Worker command line") for one local node."""
    argv = torchrun(nproc, "--nnodes", "1", "--node_rank", "0", "--rdzv_id", run_dir.name, "--max_restarts", "0",
                    "-m", "launcher.train", "--run-dir", str(run_dir))
    return argv + (["--resume", resume] if resume else [])


def worker_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}


def run_worker(run_dir: Path, nproc: int = 2, resume: str | None = None, timeout: int = 240,
               argv: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_workers([dict(run_dir=run_dir, nproc=nproc, resume=resume, argv=argv, env=env)], timeout)[0]


# Ranks the runs of one run_workers call keep in flight at most (a launch larger than this runs alone).
RANK_SLOTS = os.cpu_count() or 2


def launch_ranks(launch: dict) -> int:
    argv = launch.get("argv") or []
    return int(argv[argv.index("--nproc_per_node") + 1]) if "--nproc_per_node" in argv else launch.get("nproc", 2)


FORKRUN = ROOT / "tests" / "forkrun.py"


def forked(argv: list[str]) -> list[str]:
    """A torchrun of the worker (`-m launcher.train`) as tests/forkrun.py: the same agent and
    options, each rank forked from a process that imported the worker's engines once. Other
    scripts, and every launch when SWIFT_STUDIO_TEST_EXEC_RANKS is set, as given."""
    worker = argv[1:3] == ["-m", "torch.distributed.run"] and "launcher.train" in argv and \
        argv[argv.index("launcher.train") - 1] == "-m"
    if not worker or os.environ.get("SWIFT_STUDIO_TEST_EXEC_RANKS"):
        return argv
    return [argv[0], str(FORKRUN), *argv[3:]]


# The variables a forkserver's imports read (Python's start-up, the native libraries', the ML
# libraries'): launches that agree on them share a forkserver. Every other variable reaches the
# ranks from their agent (in-process tests and libraries set some in the test process as the suite
# runs: MASTER_ADDR, MLFLOW_*).
IMPORT_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "TRANSFORMERS",
                       "HF_", "HUGGINGFACE", "TOKENIZERS", "PEFT", "DEEPSPEED", "DS_", "ACCELERATE", "TRITON", "XDG_",
                       "HOME", "TMPDIR")
MAX_FORKSERVERS = 4  # each holds ~0.4 GB of imports; the suite's launches use two or three environments
_FORKSERVERS: dict[tuple, tuple[str, subprocess.Popen]] = {}
"""This test process's forkservers (tests/forkrun.py), by import_env, oldest first: the value of
FORKSERVER_ENV that names each, and its process."""


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES)}


def shared_forkserver(env: dict[str, str]) -> str:
    """The value of FORKSERVER_ENV (tests/forkrun.py) for a forked launch in `env`: the forkserver this
    process shares among its launches of the same import_env, started in `env` at the first of them.
    Past MAX_FORKSERVERS the oldest is let go: it ends once the ranks it forked have."""
    key = tuple(sorted(import_env(env).items()))
    if key not in _FORKSERVERS:
        if len(_FORKSERVERS) >= MAX_FORKSERVERS:
            named, _ = _FORKSERVERS.pop(next(iter(_FORKSERVERS)))
            os.close(alive_fd(named))
        server, named = start_server(env, str(ROOT))
        _FORKSERVERS[key] = named, server
    return _FORKSERVERS[key][0]


def run_workers(launches: list[dict], timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """The launches (run_worker's arguments), in order, each started once the ranks still running
    and its own fit in RANK_SLOTS (or nothing else runs), each given `timeout` seconds from its start.
    Runs that do not depend on each other fill the machine's cores (a one-rank run leaves one of two
    idle), but no more: ten two-rank DPO runs started at once on two cores took 233-237 CPU-seconds
    (tests/test_preference.py's first e2e test), 180 with at most two ranks in flight. Each process
    has `.log`, its run's log."""
    procs: list[subprocess.Popen] = []
    try:
        for launch in launches:
            ranks = launch_ranks(launch)
            while (busy := sum(p.ranks for p in procs if p.poll() is None)) and busy + ranks > RANK_SLOTS:
                wait_some(procs)
            run_dir = launch["run_dir"]
            log = run_dir / "logs" / "local.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            argv = launch.get("argv") or torchrun_argv(run_dir, launch.get("nproc", 2), launch.get("resume"))
            env, pass_fds = {**worker_env(), **(launch.get("env") or {})}, ()
            if forked(argv) != argv:
                named = shared_forkserver(env)
                env, pass_fds = {**env, FORKSERVER_ENV: named}, (alive_fd(named),)
            with open(log, "a") as out:
                proc = subprocess.Popen(forked(argv), cwd=ROOT, env=env, pass_fds=pass_fds, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            proc.log_path, proc.ranks, proc.deadline = log, ranks, time.monotonic() + timeout
            procs.append(proc)
        while any(p.poll() is None for p in procs):
            wait_some(procs)
    finally:
        for proc in procs:
            kill_tree(proc)
    for proc in procs:
        proc.log = proc.log_path.read_text()
    return procs


def wait_some(procs: list[subprocess.Popen]) -> None:
    """A moment's wait; a run past its deadline is killed (its returncode says so)."""
    time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None and time.monotonic() > proc.deadline:
            kill_tree(proc)


# Prepended to a probe script: each rank writes its outcome to a file of its own (their prints
# interleave on one line), in the directory the probe gets as sys.argv[1].
PROBE_REPORT = '''
def report(outcome):
    import os, sys, torch.distributed as dist
    with open(os.path.join(sys.argv[1], f"outcome-{dist.get_rank()}"), "w") as f:
        f.write(outcome)
'''


def probe_ranks(tmp_path: Path, nproc: int, body: str, *args) -> tuple[list[str], str]:
    """`body`, a script that calls `report(outcome)` on every rank, run by torchrun on `nproc` gloo
    ranks with `args` after the outcome directory: the outcomes in rank order (a rank that died
    before reporting has none), and the log."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE_REPORT + body)
    proc = run_worker(tmp_path, argv=torchrun(nproc, str(script), str(tmp_path), *map(str, args)))
    outcomes = [(tmp_path / f"outcome-{rank}").read_text() for rank in range(nproc)
                if (tmp_path / f"outcome-{rank}").exists()]
    return outcomes, proc.log


def run_ok(run_dir: Path, **kw) -> subprocess.CompletedProcess:
    """run_worker, asserting it succeeded; the failure shows the end of the run's log."""
    proc = run_worker(run_dir, **kw)
    assert proc.returncode == 0, proc.log[-4000:]
    return proc


def assert_same_export(run_a: Path, run_b: Path, tmp_path: Path) -> None:
    """Both runs' latest checkpoints exported to HF directories give the same logits (fp32, eval, a
    fixed batch): the same model, however each run was laid out."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.export import export

    def logits(run: Path):
        out = export(run, None, tmp_path / f"{run.name}-export")["out"]
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(input_ids=torch.arange(3, 35).reshape(2, 16)).logits

    torch.testing.assert_close(logits(run_a), logits(run_b), rtol=1e-4, atol=1e-4)


def eval_losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["eval_loss"] for e in events(run_dir, 0, "eval")}


def assert_same_eval(run_a: Path, run_b: Path, steps: list[int], rel: float = 2e-4) -> None:
    """Both runs evaluated at `steps` with the same eval losses: each engine's evaluation computes
    what the other's does (the same model, the same held-out rows on the same data-parallel ranks)."""
    import pytest

    a, b = eval_losses(run_a), eval_losses(run_b)
    assert sorted(a) == sorted(b) == steps, (a, b)
    for step in steps:
        assert a[step] == pytest.approx(b[step], rel=rel), (step, a[step], b[step])


def assert_resumes_the_same(run: Path, resumed: Path, nproc: int, step: int, steps: int,
                            *others: tuple[Path, int], env: dict[str, str] | None = None) -> None:
    """`resumed` (a run directory with its job.yaml), given `run`'s checkpoint-`step` and resumed on
    `nproc` ranks, trains steps step+1..`steps` with `run`'s losses; so does each of `others`
    ((run directory, nproc), resumed beside it). `env`: what the runs' environment adds."""
    import shutil

    import pytest

    targets = [(resumed, nproc), *others]
    for target, _ in targets:
        shutil.copytree(run / f"checkpoint-{step}", target / f"checkpoint-{step}")
    procs = run_workers([dict(run_dir=target, nproc=n, resume="latest", env=env) for target, n in targets], 400)
    for (target, _), proc in zip(targets, procs):
        assert proc.returncode == 0, f"{target.name}: {proc.log[-4000:]}"
        again, before = losses(target), losses(run)
        assert sorted(again) == list(range(step + 1, steps + 1)), target.name
        for at, value in again.items():
            assert value == pytest.approx(before[at], rel=2e-4), (target.name, at)


EQUALITY_STEPS = 20
EQUALITY_JOB = dict(dataset=[str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"], max_length=64,
                    per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-3,
                    max_steps=EQUALITY_STEPS, logging_steps=1, save_steps=10, gradient_checkpointing=False,
                    warmup_ratio=0.1, torch_dtype="float32", lora_dropout=0.0)
"""The job the layout tests train with and without a parallel dimension: 20 logged steps (a
checkpoint at 10) of the demo data in fp32, where equal losses mean equal training."""


def equality_job(model: Path, **extra) -> dict:
    return {"model": str(model), **EQUALITY_JOB, **extra}


def trained(tmp_path: Path, name: str, nproc: int, **spec) -> Path:
    """A run directory `name` under `tmp_path` with `spec` as its job, trained on `nproc` ranks."""
    run, = trained_together(tmp_path, (name, nproc, spec))
    return run


def trained_together(tmp_path: Path, *runs: tuple[str, int, dict]) -> list[Path]:
    """`trained` for each (name, nproc, spec), the runs side by side."""
    dirs = [write_run(tmp_path / name, **spec) for name, _, spec in runs]
    for run, proc in zip(dirs, run_workers([dict(run_dir=d, nproc=n) for d, (_, n, _) in zip(dirs, runs)], 400)):
        assert proc.returncode == 0, f"{run.name}: {proc.log[-4000:]}"
    return dirs


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill torchrun and its workers by pid (torchrun puts each worker in its own session)."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def planned(run_dir: Path, **spec) -> dict:
    """A launch (run_workers' entry) the way the backend makes it: backend.job.planner's files
    written, its argv and environment for this machine (CPU)."""
    from backend.job.cluster import GpuInfo, local_cluster
    from backend.job.planner import plan
    from backend.job.spec import parse_spec

    job, problems = parse_spec(spec)
    assert job is not None, problems
    made = plan(job, local_cluster(GpuInfo()), run_dir.name, run_dir, master_port=free_port())
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in made.files.items():
        (run_dir / name).write_text(text)
    node, = made.nodes
    return dict(run_dir=run_dir, argv=list(node.argv), env=node.env)


def run_planned(run_dir: Path, timeout: int = 240, **spec) -> subprocess.CompletedProcess:
    """Launch the way the backend does (`planned`) and wait for it."""
    return run_workers([planned(run_dir, **spec)], timeout)[0]


def events(run_dir: Path, rank: int = 0, type: str | None = None) -> list[dict]:
    path = run_dir / "events" / f"rank-{rank}.jsonl"
    # A running worker may be mid-line: only the lines it has ended count.
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    rows = [json.loads(line) for line in lines if line]
    return [r for r in rows if type is None or r["type"] == type]


def assert_timing_from_every_rank(run_dir: Path, nproc: int, steps) -> None:
    """Every rank reported its step time, collective wait and peak memory at every logged step (what
    the Monitor's per-rank charts and the straggler alert read), whatever the layout."""
    for rank in range(nproc):
        timing = events(run_dir, rank, "timing")
        assert [e["step"] for e in timing] == list(steps), rank
        assert all(e["step_time_s"] > 0 and e["collective_wait_s"] >= 0 and e["mem_peak_gib"] > 0 for e in timing), rank


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir, 0, "train")}


def until(what, timeout: float = 240.0, every: float = 0.1, name: str = "", why=None):
    """`what()` once it is truthy, polled every `every` s; AssertionError after `timeout` s, naming
    what was awaited (`name`) and what `why()` says of the state then."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"{name or 'the condition'}: not within {timeout:.0f} s" + (f"\n{why()}" if why else ""))
