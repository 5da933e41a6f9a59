"""The launch planner: torchrun argv that torch's own parser accepts, env, files, DeepSpeed batch sizes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from backend.job.cluster import GpuInfo, local_cluster, parse_hostfile_text
from backend.job.dsconfig import build_ds_config
from backend.job.modelcfg import find_model_config
from backend.job.planner import CODE_ROOT, PlanError, plan
from backend.job.spec import JobSpec, load_spec

RUN_ID = "20261130-041500-a1b2c3"


def job(**kw) -> JobSpec:
    return JobSpec(**{"model": "Qwen/Qwen2.5-7B-Instruct", "dataset": ["swift/self-cognition#500"], **kw})


def torchrun_args(argv):
    """Parse a node's argv the way `python -m torch.distributed.run` does."""
    from torch.distributed.run import get_args_parser

    assert list(argv[1:3]) == ["-m", "torch.distributed.run"]
    return get_args_parser().parse_args(list(argv[3:]))


def test_two_gpu_nodes_argv_parses_with_torchrun(tmp_path):
    cluster = parse_hostfile_text("gpu-a slots=8 addr=10.0.0.1 python=/opt/venv/bin/python\ngpu-b slots=8\n")
    result = plan(job(nnodes=2, deepspeed="zero2", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                      env={"NCCL_IB_HCA": "mlx5"}),
                  cluster, RUN_ID, tmp_path / "run", master_port=29611)
    assert [n.node_rank for n in result.nodes] == [0, 1]
    for node in result.nodes:
        args = torchrun_args(node.argv)
        assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", node.node_rank)
        assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.max_restarts) == ("c10d", "10.0.0.1:29611", RUN_ID, 0)
        assert args.module and args.training_script == "launcher.train"
        assert args.training_script_args == ["--run-dir", str(tmp_path / "run")]
        assert args.local_addr is None  # real network: NCCL/gloo pick the interface
        assert node.env["SWIFT_STUDIO_RUN_ID"] == RUN_ID and node.env["MASTER_ADDR"] == "10.0.0.1"
        assert node.env["MASTER_PORT"] == "29611" and node.env["NCCL_IB_HCA"] == "mlx5"
        assert "GLOO_SOCKET_IFNAME" not in node.env
    assert result.nodes[0].argv[0] == "/opt/venv/bin/python" and result.nodes[1].argv[0] == "python3"
    assert result.ds_config["train_batch_size"] == 2 * 4 * 16
    assert result.layout.world == 16 and result.layout.dp == 16


def test_loopback_nodes_get_local_addr_and_lo(tmp_path):
    cluster = parse_hostfile_text("127.0.0.2 slots=2 device=cpu ssh_port=2222\n127.0.0.3 slots=2 device=cpu ssh_port=2223\n")
    result = plan(job(nnodes=2, nproc_per_node=1), cluster, RUN_ID, tmp_path / "run")
    for node, addr in zip(result.nodes, ("127.0.0.2", "127.0.0.3")):
        args = torchrun_args(node.argv)
        assert args.local_addr == addr and args.rdzv_endpoint == "127.0.0.2:29500"
        assert node.env["GLOO_SOCKET_IFNAME"] == "lo" and node.env["NCCL_SOCKET_IFNAME"] == "lo"
    assert result.backend == "gloo"


def test_spec_env_overrides_interface_defaults(tmp_path):
    cluster = parse_hostfile_text("127.0.0.2 slots=1 device=cpu\n")
    result = plan(job(env={"GLOO_SOCKET_IFNAME": "eth1"}), cluster, RUN_ID, tmp_path / "r")
    assert result.nodes[0].env["GLOO_SOCKET_IFNAME"] == "eth1"


def test_local_cluster_resolves_nproc_and_uses_127_0_0_1(tmp_path):
    result = plan(job(), local_cluster(GpuInfo(("H200",) * 4, 139.8)), RUN_ID, tmp_path / "run", resume="latest")
    node = result.nodes[0]
    args = torchrun_args(node.argv)
    assert args.nproc_per_node == "4" and args.rdzv_endpoint == "127.0.0.1:29500" and args.local_addr == "127.0.0.1"
    assert args.training_script_args[-2:] == ["--resume", "latest"]
    assert node.env["PYTHONPATH"] == CODE_ROOT and node.local
    assert yaml.safe_load(result.files["job.yaml"])["nproc_per_node"] == 4


def test_files_for_the_run_directory(tmp_path, monkeypatch):
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ref").mkdir()
    spec = job(dataset=["data/train.jsonl#100", "swift/self-cognition"], output_dir="out", deepspeed="zero3",
               ref_model="ref")
    result = plan(spec, local_cluster(GpuInfo(("A100",) * 2, 80.0)), RUN_ID, tmp_path / "out" / RUN_ID,
                  model_config=find_model_config(spec.model))
    assert set(result.files) == {"job.yaml", "ds_config.json", "plan.json"}
    written = tmp_path / "written"
    written.mkdir()
    (written / "job.yaml").write_text(result.files["job.yaml"])
    back, problems = load_spec(written / "job.yaml")
    assert problems == []
    assert back.dataset == [f"{data}#100", "swift/self-cognition"]  # local file absolute, hub id untouched
    assert back.output_dir == str(tmp_path / "out") and back.ref_model == str(tmp_path / "ref")
    ds = json.loads(result.files["ds_config.json"])
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] and ds["train_batch_size"] == 2
    # HF's hidden-size rule (3584^2 = 12.8M) gives less than DeepSpeed's defaults here: those win.
    assert ds["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert json.loads(result.files["plan.json"])["memory"]["total_gib"] > 0


def test_argv_is_usable_from_any_directory(tmp_path):
    """Every path in the argv is absolute, and the worker module is found via PYTHONPATH."""
    result = plan(job(), local_cluster(GpuInfo()), RUN_ID, tmp_path / "run")
    node = result.nodes[0]
    run_dir = node.argv[node.argv.index("--run-dir") + 1]
    assert Path(run_dir).is_absolute() and Path(node.argv[0]).is_absolute()
    assert (Path(node.env["PYTHONPATH"]) / "launcher" / "train.py").is_file()


def test_no_deepspeed_no_ds_file(tmp_path):
    result = plan(job(fsdp="full_shard"), local_cluster(GpuInfo(("A100",), 80.0)), RUN_ID, tmp_path / "r")
    assert result.ds_config is None and "ds_config.json" not in result.files


def test_plan_errors(tmp_path):
    cluster = parse_hostfile_text("a slots=1\n")
    with pytest.raises(PlanError, match="absolute"):
        plan(job(), cluster, RUN_ID, "relative/run")
    with pytest.raises(PlanError, match="nnodes"):
        plan(job(nnodes=2), cluster, RUN_ID, tmp_path)


@pytest.mark.parametrize("micro,accum,world,tp,sp,expected", [
    (1, 1, 8, 1, 1, 8), (2, 8, 16, 1, 1, 256), (1, 16, 8, 1, 4, 32),
    (4, 2, 8, 2, 1, 64),  # AutoTP: DeepSpeed's batch check counts the TP ranks too (dsconfig.batch_fields)
])
def test_train_batch_size_is_micro_accum_dp(micro, accum, world, tp, sp, expected, tmp_path):
    spec = job(per_device_train_batch_size=micro, gradient_accumulation_steps=accum, nproc_per_node=world,
               tensor_model_parallel_size=tp, sequence_parallel_size=sp, deepspeed="zero1", train_type="full")
    result = plan(spec, parse_hostfile_text(f"n slots={world}\n"), RUN_ID, tmp_path)
    assert result.ds_config["train_batch_size"] == expected == micro * accum * result.layout.dp * tp


def test_ds_presets():
    for name, stage in (("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
        config = build_ds_config(job(deepspeed=name), 4)
        assert config["zero_optimization"]["stage"] == stage and "offload_optimizer" not in config["zero_optimization"]
    z2o = build_ds_config(job(deepspeed="zero2_offload", torch_dtype="float16", max_grad_norm=0.5), 2)["zero_optimization"]
    assert z2o["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z2o
    z3o = build_ds_config(job(deepspeed="zero3_offload"), 2)
    assert z3o["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert z3o["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # hidden size unknown: DeepSpeed's default
    fp16 = build_ds_config(job(deepspeed="zero2", torch_dtype="float16", max_grad_norm=0.5), 2)
    assert fp16["fp16"]["enabled"] and not fp16["bf16"]["enabled"] and fp16["gradient_clipping"] == 0.5


def test_user_json_auto_fields_are_filled(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
                                "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_batch_size": "auto",
                                "optimizer": {"type": "AdamW"}}))
    config = build_ds_config(job(deepspeed=str(path), per_device_train_batch_size=2), 4, hidden_size=1000)
    assert config["train_batch_size"] == 8 and config["bf16"]["enabled"] is True and config["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000 and config["optimizer"] == {"type": "AdamW"}
    assert "communication_data_type" not in config  # gradients travel in the compute dtype, DeepSpeed's default
    wide = build_ds_config(job(deepspeed=str(path), grad_reduce_dtype="float32"), 4, hidden_size=8192)
    assert wide["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 8192**2)  # the rule wins above ~7.5k
    assert wide["communication_data_type"] == "fp32"


def test_worker_sets_the_batch_fields_of_the_run_directory_config(tmp_path):
    from launcher.config import load_ds_config

    (tmp_path / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": 64}))
    config = load_ds_config(tmp_path, job(deepspeed="zero2", per_device_train_batch_size=2, gradient_accumulation_steps=3), 4, None, 100)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 3, 24)


@pytest.mark.parametrize("content,message", [
    (b'{"zero_optimization":\n  {"stage": 2,}}', "ds_config.json:2: DeepSpeed config is not valid JSON"),
    (b"\xff\xfe{}", "ds_config.json: cannot read DeepSpeed config"),
])
def test_worker_reports_a_broken_run_directory_config(tmp_path, content, message):
    from launcher.config import ConfigError, load_ds_config

    (tmp_path / "ds_config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_ds_config(tmp_path, job(deepspeed="zero2"), 1, None, 100)


def test_deepspeed_accepts_the_config():
    """DeepSpeed's own config class checks train_batch_size = micro x accumulation x world."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for preset in ("zero2", "zero3_offload"):
        config = build_ds_config(job(deepspeed=preset, per_device_train_batch_size=2, gradient_accumulation_steps=3), 1)
        parsed = DeepSpeedConfig(config)
        assert (parsed.train_batch_size, parsed.zero_optimization_stage) == (6, int(preset[4]))
