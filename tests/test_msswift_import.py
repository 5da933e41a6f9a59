"""`swift-studio import`: the command lines of ms-swift's docs become specs that validate."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from backend.job import capabilities
from backend.job.cluster import parse_hostfile_text
from backend.job.layout import compute_layout
from backend.job.memory import adapts_stacked_params
from backend.job.modelcfg import find_model_config
from backend.job.msswift import CommandError, import_command
from backend.job.spec import JobSpec, canonical_key, parse_spec
from backend.job.validate import errors, validate
from msswift_examples import EXAMPLES
from studio.commands import swift_command

ROOT = Path(__file__).resolve().parent.parent

# examples/train/multi-gpu/deepspeed (single node, ZeRO-2, LoRA), as the docs write it.
SINGLE_NODE_ZERO2_LORA = r"""
# 4 * 24GiB
NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --torch_dtype bfloat16 \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' \
              'AI-ModelScope/alpaca-gpt4-data-en#500' \
              'swift/self-cognition#500' \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps $(expr 16 / 4) \
    --eval_steps 50 \
    --save_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --model_author swift \
    --model_name swift-robot \
    --deepspeed zero2
"""

# examples/train/multi-node/swift/train_node1.sh (2 nodes x 4 GPUs, full, ZeRO-2).
TWO_NODE_ZERO2 = r"""
nnodes=2
nproc_per_node=4

CUDA_VISIBLE_DEVICES=0,1,2,3 \
NNODES=$nnodes \
NODE_RANK=0 \
MASTER_ADDR=127.0.0.1 \
MASTER_PORT=29500 \
NPROC_PER_NODE=$nproc_per_node \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#20000' \
              'AI-ModelScope/alpaca-gpt4-data-en#20000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps $(expr 32 / $nproc_per_node / $nnodes) \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 8192 \
    --output_dir output \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --deepspeed zero2
"""

# examples/train/multi-node/torchrun/train_node2.sh: the same job started by torchrun.
TWO_NODE_TORCHRUN = r"""
nnodes=2
nproc_per_node=4

CUDA_VISIBLE_DEVICES=0,1,2,3 \
torchrun \
    --master_port 29500 \
    --nproc_per_node=$nproc_per_node \
    --nnodes=$nnodes \
    --node_rank=1 \
    --master_addr=xxx.xxx.xxx.xxx \
    swift/cli/sft.py \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#20000' \
              'AI-ModelScope/alpaca-gpt4-data-en#20000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps $(expr 32 / $nproc_per_node / $nnodes) \
    --max_length 8192 \
    --deepspeed zero2
"""

# examples/train/megatron/multi-node/node1.sh (Megatron-SWIFT, TP=4) with PP=2 as in the PP examples.
MEGATRON_TP_PP = r"""
PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
NNODES=2 \
NODE_RANK=0 \
MASTER_ADDR=127.0.0.1 \
MASTER_PORT=29500 \
NPROC_PER_NODE=4 \
megatron sft \
    --load Qwen2.5-14B-mcore \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT' \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 4 \
    --pipeline_model_parallel_size 2 \
    --micro_batch_size 1 \
    --global_batch_size 16 \
    --packing true \
    --recompute_granularity selective \
    --train_iters 2000 \
    --eval_iters 50 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_iters 100 \
    --min_lr 1e-6 \
    --save megatron_output/Qwen2.5-14B \
    --eval_interval 200 \
    --save_interval 200 \
    --max_length 8192 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --sequence_parallel true \
    --use_flash_attn true
"""

# examples/train/sequence_parallel/sequence_parallel.sh (Ulysses, 8 GPUs).
ULYSSES = r"""
# Env: 8 * A100
NPROC_PER_NODE=8 \
CELOSS_PARALLEL_SIZE=2048 \
swift sft \
    --model Qwen/Qwen2.5-3B-Instruct \
    --dataset 'AI-ModelScope/LongAlpaca-12k' \
    --load_from_cache_file true \
    --train_type lora \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 4 \
    --target_modules all-linear \
    --gradient_accumulation_steps 8 \
    --save_total_limit 2 \
    --save_only_model true \
    --save_steps 50 \
    --max_length 65536 \
    --warmup_ratio 0.05 \
    --attn_impl flash_attn \
    --sequence_parallel_size 8 \
    --logging_steps 1 \
    --use_logits_to_keep false \
    --padding_free true
"""

CLUSTERS = {"1x4": "gpu0 slots=4\n", "2x4": "gpu0 slots=4\ngpu1 slots=4\n", "1x8": "gpu0 slots=8\n"}


def imported(text):
    result = import_command(text)
    spec, problems = parse_spec(result.spec)
    assert problems == [], problems
    return spec, result


def assert_validates(spec, cluster_text):
    """No errors except what this worker refuses (TP/PP/SP > 1: it trains data-parallel only)."""
    found = errors(validate(spec, parse_hostfile_text(cluster_text)))
    refused = {(p.field, p.message) for p in capabilities.unsupported(spec)}
    model = find_model_config(spec.model)  # the bundled configs know these models' shapes
    if model is not None:  # e.g. LoRA on the experts under EP: refused naming what does not run
        refused |= {(p.field, p.message) for p in capabilities.ep_model_problems(
            spec, model.is_moe, model.num_experts, model.tie_word_embeddings, adapts_stacked_params(spec, model))}
    assert [p for p in found if (p.field, p.message) not in refused] == []


def test_single_node_zero2_lora():
    spec, result = imported(SINGLE_NODE_ZERO2_LORA)
    assert (spec.nproc_per_node, spec.nnodes, spec.deepspeed, spec.train_type) == (4, 1, "zero2", "lora")
    assert spec.dataset == ["AI-ModelScope/alpaca-gpt4-data-zh#500", "AI-ModelScope/alpaca-gpt4-data-en#500", "swift/self-cognition#500"]
    assert (spec.gradient_accumulation_steps, spec.lora_rank, spec.lora_alpha, spec.warmup_ratio) == (4, 8, 32, 0.05)
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    # The quick start's own flags are kept: the system prompt and the self-cognition names.
    assert (spec.system, spec.model_author, spec.model_name) == ("You are a helpful assistant.", ["swift"], ["swift-robot"])
    assert result.ignored == ["--dataloader_num_workers 4"] and spec.eval_steps == 50
    assert_validates(spec, CLUSTERS["1x4"])
    assert validate(spec, parse_hostfile_text(CLUSTERS["1x4"])) == []


@pytest.mark.parametrize("text", [TWO_NODE_ZERO2, TWO_NODE_TORCHRUN], ids=["env-prefix", "torchrun"])
def test_two_node_zero2(text):
    spec, result = imported(text)
    assert (spec.nnodes, spec.nproc_per_node, spec.deepspeed, spec.train_type) == (2, 4, "zero2", "full")
    assert spec.gradient_accumulation_steps == 4 and spec.max_length == 8192 and spec.learning_rate == 1e-5
    assert any("MASTER_ADDR" in n or "--master_addr" in n for n in result.notes)
    assert_validates(spec, CLUSTERS["2x4"])


def test_megatron_tp_pp():
    spec, result = imported(MEGATRON_TP_PP)
    assert (spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.nnodes, spec.nproc_per_node) == (4, 2, 2, 4)
    assert spec.model == "Qwen2.5-14B-mcore" and spec.output_dir == "megatron_output/Qwen2.5-14B"
    assert (spec.max_steps, spec.save_steps, spec.learning_rate, spec.packing) == (2000, 200, 1e-5, True)
    assert spec.gradient_accumulation_steps == 16  # global 16 / (micro 1 x DP 8 / (TP 4 x PP 2) = 1)
    assert spec.warmup_ratio == pytest.approx(0.05) and spec.attn_impl == "flash_attention_2" and spec.gradient_checkpointing
    assert spec.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert "--min_lr 1e-6" in result.ignored and "--finetune true" in result.ignored
    assert_validates(spec, CLUSTERS["2x4"])
    layout_errors = errors(validate(spec, parse_hostfile_text(CLUSTERS["2x4"])))
    # The worker's pipeline refuses TP beside it and gradient checkpointing, each by name.
    assert {p.field for p in layout_errors} <= {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                "gradient_checkpointing"}


def test_ulysses_sequence_parallel():
    spec, result = imported(ULYSSES)
    assert (spec.sequence_parallel_size, spec.nproc_per_node, spec.max_length, spec.attn_impl) == (8, 8, 65536, "flash_attention_2")
    assert spec.env == {"CELOSS_PARALLEL_SIZE": "2048"}
    assert spec.padding_free  # each micro-batch's samples in one row; with SP, flash-attention reads their bounds
    assert_validates(spec, CLUSTERS["1x8"])


@pytest.mark.parametrize("text", [SINGLE_NODE_ZERO2_LORA, TWO_NODE_ZERO2, MEGATRON_TP_PP, ULYSSES])
def test_yaml_round_trip_keeps_what_was_ignored(text):
    spec, result = imported(text)
    text_out = result.yaml_text(spec)
    back, problems = parse_spec(yaml.safe_load(text_out))
    assert problems == [] and back == spec
    for line in result.ignored:
        assert f"# ignored: {line}" in text_out


def test_unknown_flag_and_bad_values():
    result = import_command("swift sft --model m --dataset d --lora_rnak 8 --num_train_epochs 1 2")
    assert result.ignored == ["--lora_rnak 8", "--num_train_epochs 1 2 (one value expected)"]
    _, problems = parse_spec(import_command("swift sft --model m --dataset d --lora_rank eight").spec)
    assert [p.field for p in problems] == ["lora_rank"]


@pytest.mark.parametrize("text,message", [
    ("ls -l", "no 'swift sft'"),
    ("swift sft --model 'unclosed", "cannot split"),
    ("swift pt --model m", "is pre-training"),
    ("swift sft --gradient_accumulation_steps $(expr 4 / 0)", "cannot evaluate"),
])
def test_unusable_commands(text, message):
    with pytest.raises(CommandError, match=message):
        import_command(text)


# -- ms-swift's defaults for what a command leaves out (issue 15) -------------------------------
# examples/train/full/train.sh on ms-swift main (4.x): full fine-tuning, one GPU, no NPROC_PER_NODE.
FULL_ONE_GPU = r"""
# 76GiB
CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --tuner_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' \
              'AI-ModelScope/alpaca-gpt4-data-en#500' \
              'swift/self-cognition#500' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps 16 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --model_author swift \
    --model_name swift-robot
"""

# examples/train/multi-gpu/device_map/train.sh (main): two GPUs visible, one process.
DEVICE_MAP = r"""
# 2 * 76GiB
CUDA_VISIBLE_DEVICES=0,1 \
MAX_PIXELS=1003520 \
swift sft \
    --model Qwen/Qwen2.5-VL-72B-Instruct \
    --dataset 'modelscope/coco_2014_caption:validation#20000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --tuner_type lora \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --freeze_vit true \
    --gradient_accumulation_steps 16 \
    --save_steps 100 \
    --save_total_limit 2 \
    --max_length 2048 \
    --output_dir output
"""

# examples/train/multi-gpu/ddp_device_map/train.sh (main): 4 GPUs for 2 processes.
DDP_DEVICE_MAP = r"""
# 14GiB * 4
nproc_per_node=2

CUDA_VISIBLE_DEVICES=0,1,2,3 \
NPROC_PER_NODE=$nproc_per_node \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --tuner_type lora \
    --dataset 'swift/self-cognition#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \
    --max_length 2048 \
    --output_dir output \
    --gradient_checkpointing_kwargs '{"use_reentrant": false}'
"""

# examples/megatron/dense/qwen3_32b.sh (main): no --tuner_type, TP=8 on 8 GPUs.
MEGATRON_QWEN3_32B = r"""
# 8 * 80GiB
PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=8 \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
megatron sft \
    --model Qwen/Qwen3-32B \
    --save_safetensors true \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 8 \
    --micro_batch_size 1 \
    --global_batch_size 16 \
    --packing true \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --num_train_epochs 5 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-6 \
    --output_dir megatron_output/Qwen3-32B \
    --eval_steps 500 \
    --save_steps 500 \
    --max_length 8192 \
    --dataloader_num_workers 8 \
    --no_save_optim true \
    --no_save_rng true \
    --sequence_parallel true \
    --attention_backend flash
"""

# A user's ZeRO-3 full fine-tuning that leaves epochs, learning rate and accumulation to ms-swift.
ZERO3_LEFT_TO_DEFAULTS = r"""
# 4 * 80GiB
NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --tuner_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#2000' \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 3 \
    --max_length 4096 \
    --deepspeed zero3 \
    --output_dir output
"""


def _without(text, *flags):
    """The script with the lines of `flags` taken out (a user's edit of a docs example)."""
    return "\n".join(line for line in text.splitlines() if line.strip().split(" ")[0] not in flags)


@pytest.mark.parametrize("name", ["tuner_type", "train_type"])
def test_tuner_type_is_the_train_type(name):
    spec, result = imported(FULL_ONE_GPU.replace("--tuner_type", f"--{name}"))
    assert spec.train_type == "full" and result.problems == []
    assert not any("tuner_type" in line for line in result.ignored)


def test_tuner_type_and_train_type_that_disagree_are_one_problem_naming_both():
    result = import_command(FULL_ONE_GPU.replace("--tuner_type full", "--tuner_type full --train_type lora"))
    spec, problems = result.parse()
    assert spec is None and [p.field for p in problems] == ["--tuner_type, --train_type"]
    assert "tuner_type full" in problems[0].message and "train_type lora" in problems[0].message
    spec, problems = import_command(FULL_ONE_GPU.replace("--tuner_type full", "--tuner_type full --train_type full")).parse()
    assert problems == [] and spec.train_type == "full"


def test_megatron_sft_trains_full_by_default():
    spec, result = imported(MEGATRON_QWEN3_32B)
    assert spec.train_type == "full" and spec.learning_rate == 1e-5
    assert any(d.startswith("train_type full") for d in result.defaults)
    # Without --lr Megatron-SWIFT takes 1e-5 for full fine-tuning, 1e-4 for LoRA.
    spec, result = imported(_without(MEGATRON_QWEN3_32B, "--lr"))
    assert spec.learning_rate == 1e-5 and any(d.startswith("learning_rate 1e-05") for d in result.defaults)
    spec, _ = imported(_without(MEGATRON_QWEN3_32B, "--lr").replace("megatron sft \\", "megatron sft \\\n    --tuner_type lora \\"))
    assert (spec.train_type, spec.learning_rate) == ("lora", 1e-4)


def test_without_nproc_per_node_ms_swift_runs_one_process():
    cluster = parse_hostfile_text(CLUSTERS["1x8"])
    for text in (FULL_ONE_GPU, DEVICE_MAP):
        spec, result = imported(text)
        assert spec.nproc_per_node == 1 and compute_layout(spec, cluster).world == 1
        assert any(d.startswith("nproc_per_node 1") for d in result.defaults)
    # Two visible GPUs for one process: ms-swift splits the model over them (device_map).
    _, result = imported(DEVICE_MAP)
    assert any("device_map" in n for n in result.notes)
    # NNODES alone: torchrun's default of one process per node; torchrun's own default too.
    spec, _ = imported(TWO_NODE_ZERO2.replace("NPROC_PER_NODE=$nproc_per_node \\\n", ""))
    assert (spec.nnodes, spec.nproc_per_node) == (2, 1)
    spec, _ = imported(TWO_NODE_TORCHRUN.replace("    --nproc_per_node=$nproc_per_node \\\n", ""))
    assert (spec.nnodes, spec.nproc_per_node) == (2, 1)


def test_cuda_visible_devices_per_process_as_ms_swift_divides_them():
    spec, result = imported(DDP_DEVICE_MAP)
    assert spec.nproc_per_node == 2 and spec.gradient_accumulation_steps == 8
    assert any("CUDA_VISIBLE_DEVICES=0,1,2,3 with 2 process(es)" in n and "device_map" in n for n in result.notes)
    # 3 GPUs for 2 processes: ms-swift asserts n_gpu % local_world_size == 0.
    _, problems = import_command(DDP_DEVICE_MAP.replace("0,1,2,3", "0,1,2")).parse()
    assert [p.field for p in problems] == ["CUDA_VISIBLE_DEVICES"] and "do not divide" in problems[0].message
    # A device_map with DeepSpeed is refused by ms-swift ('DeepSpeed is not compatible with device_map').
    _, problems = import_command(DEVICE_MAP.replace("--tuner_type lora", "--tuner_type lora --deepspeed zero2")).parse()
    assert [p.field for p in problems] == ["CUDA_VISIBLE_DEVICES"] and "--deepspeed" in problems[0].message


def test_omitted_flags_take_ms_swift_defaults():
    spec, result = imported(ZERO3_LEFT_TO_DEFAULTS)
    # ceil(16 / (3 x 4)) = 2 (floor would be 1); 3 epochs (HF); 1e-5 for full fine-tuning.
    assert (spec.gradient_accumulation_steps, spec.num_train_epochs, spec.learning_rate) == (2, 3.0, 1e-5)
    assert [d.split(" ")[0] for d in result.defaults] == ["learning_rate", "strict", "num_train_epochs", "gradient_accumulation_steps",
                                                        "adam_beta2:"]
    assert "ceil(16 / (batch 3 x world 4))" in result.defaults[3]
    assert not spec.strict and "swift/arguments/base_args/data_args.py" in result.defaults[1]
    # LoRA's 1e-4 is swift-studio's too: nothing to fill. max_steps > 0 makes the epochs moot.
    spec, result = imported(ZERO3_LEFT_TO_DEFAULTS.replace("--tuner_type full", "--tuner_type lora --max_steps 100"))
    assert (spec.learning_rate, spec.num_train_epochs, spec.gradient_accumulation_steps) == (1e-4, 1.0, 2)
    assert [d.split(" ")[0] for d in result.defaults] == ["strict", "gradient_accumulation_steps", "adam_beta2:"]
    # A line that says --strict keeps it.
    spec, result = imported(ZERO3_LEFT_TO_DEFAULTS.replace("--output_dir output", "--output_dir output --strict true"))
    assert spec.strict and not any(d.startswith("strict") for d in result.defaults)
    # Model-dependent defaults are named, not guessed.
    _, result = imported(_without(ZERO3_LEFT_TO_DEFAULTS, "--max_length", "--torch_dtype"))
    assert any(d.startswith("max_length: the model's max_model_len") for d in result.defaults)
    assert any(d.startswith("torch_dtype:") for d in result.defaults)


def test_save_total_limit_minus_one_is_no_limit():
    spec, result = imported(FULL_ONE_GPU.replace("--save_total_limit 2", "--save_total_limit -1"))
    assert spec.save_total_limit is None and any(n.startswith("--save_total_limit -1: no limit") for n in result.notes)
    # Megatron-SWIFT refuses fewer than 2.
    _, problems = import_command(MEGATRON_QWEN3_32B.replace("--save_steps 500", "--save_steps 500 --save_total_limit 1")).parse()
    assert [p.field for p in problems] == ["--save_total_limit"]


def test_megatron_gradient_accumulation_divides_by_data_parallel_size():
    tp2_pp2 = MEGATRON_QWEN3_32B.replace("--tensor_model_parallel_size 8",
                                         "--tensor_model_parallel_size 2 --pipeline_model_parallel_size 2")
    # 8 GPUs / (TP 2 x PP 2) = DP 2: global 16 / (micro 1 x DP 2) = 8 (not 16 / world 8).
    spec, result = imported(tp2_pp2)
    assert spec.gradient_accumulation_steps == 8
    # --global_batch_size left out: Megatron-SWIFT's 16, the same DP.
    spec, result = imported(_without(tp2_pp2, "--global_batch_size"))
    assert spec.gradient_accumulation_steps == 8 and any("--global_batch_size defaults to 16" in d for d in result.defaults)
    micro2 = tp2_pp2.replace("--micro_batch_size 1", "--micro_batch_size 2")
    spec, _ = imported(micro2.replace("--global_batch_size 16", "--global_batch_size 32"))
    assert spec.gradient_accumulation_steps == 8
    _, problems = import_command(micro2.replace("--global_batch_size 16", "--global_batch_size 18")).parse()
    assert [p.field for p in problems] == ["--global_batch_size"] and "micro 2 x DP 2" in problems[0].message


def test_megatron_epochs_decide_the_steps():
    spec, result = imported(MEGATRON_QWEN3_32B.replace("--num_train_epochs 5", "--num_train_epochs 5 --train_iters 2000"))
    assert (spec.num_train_epochs, spec.max_steps) == (5, -1) and any("--train_iters 2000 dropped" in n for n in result.notes)
    _, problems = import_command(_without(MEGATRON_QWEN3_32B, "--num_train_epochs")).parse()
    assert [p.field for p in problems] == ["--train_iters"]


def test_cli_import_writes_the_ms_swift_job_and_its_filled_defaults(tmp_path):
    script = tmp_path / "train_zero3.sh"
    script.write_text(ZERO3_LEFT_TO_DEFAULTS)
    done = subprocess.run([sys.executable, "-m", "backend.cli", "import", script.read_text()], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = yaml.safe_load(done.stdout)
    assert (data["train_type"], data["nproc_per_node"], data["deepspeed"]) == ("full", 4, "zero3")
    assert (data["num_train_epochs"], data["learning_rate"], data["gradient_accumulation_steps"]) == (3.0, 1e-5, 2)
    comments = [line for line in done.stdout.splitlines() if line.startswith("# ms-swift default: ")]
    assert [c.split(" ")[3] for c in comments] == ["learning_rate", "strict", "num_train_epochs", "gradient_accumulation_steps",
                                                        "adam_beta2:"]


@pytest.mark.parametrize("spec", [
    JobSpec(model="Qwen/Qwen2.5-7B-Instruct", dataset=["a.jsonl"], train_type="full", nproc_per_node=4),
    JobSpec(model="Qwen/Qwen2.5-7B-Instruct", dataset=["a.jsonl"], train_type="full", nproc_per_node=4, num_train_epochs=3,
            learning_rate=1e-5, gradient_accumulation_steps=4),
], ids=["swift-studio-defaults", "ms-swift-defaults"])
def test_swift_command_states_what_ms_swift_would_not_default_to(spec):
    line = swift_command(spec)
    assert "--tuner_type full" in line
    stated = ("--num_train_epochs" in line, "--learning_rate" in line, "--gradient_accumulation_steps" in line)
    assert stated == ((True, True, True) if spec.num_train_epochs == 1 else (False, False, False))
    back, problems = import_command(line).parse()
    assert problems == [] and back == spec


def test_a_dpo_job_is_a_swift_rlhf_line_that_imports_back():
    spec = JobSpec(model="Qwen/Qwen2.5-7B-Instruct", dataset=["pairs.jsonl"], nproc_per_node=2, rlhf_type="dpo",
                   beta=0.2, loss_type="ipo", rpo_alpha=0.1, precompute_ref_log_probs=True)
    line = swift_command(spec)
    assert line.startswith("NPROC_PER_NODE=2 swift rlhf") and "--rlhf_type dpo" in line and "--loss_type ipo" in line
    assert "--precompute_ref_log_probs true" in line
    back, problems = import_command(line).parse()
    assert problems == [] and back == spec
    # swift sft's own --loss_type is not DPO's; swift rlhf's other algorithms are refused by name
    assert "--loss_type cross_entropy" in import_command("swift sft --model m --dataset d --loss_type cross_entropy").ignored
    assert import_command("swift sft --model m --dataset d --precompute_ref_log_probs true").ignored == [
        "--precompute_ref_log_probs true"]
    _, problems = import_command("swift rlhf --rlhf_type kto --model m --dataset d").parse()
    assert [p.field for p in problems] == ["--rlhf_type"] and "swift-studio trains 'dpo'" in problems[0].message
    # ms-swift's default rlhf_type is dpo
    assert import_command("swift rlhf --model m --dataset d").parse()[0].rlhf_type == "dpo"


def example_cluster(spec: JobSpec):
    """Nodes enough for the job: nnodes hosts of nproc_per_node GPUs (8 where it is left empty)."""
    return parse_hostfile_text("".join(f"gpu{i} slots={spec.nproc_per_node or 8}\n" for i in range(spec.nnodes)))


@pytest.mark.parametrize("name,where,text,covers", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_an_ms_swift_example_gives_a_job_that_runs_or_is_refused_naming_what_is_not_supported(name, where, text,
                                                                                            covers):
    """The property over the flag sets of ms-swift's examples (tests/msswift_examples.py, modelled on
    the scripts it names at msswift_examples.PINNED): the import validates on a cluster of its layout, or
    what stops it names a flag or feature this studio does not run. Nothing else may stop it."""
    try:
        result = import_command(text)
    except CommandError as exc:
        assert "is pre-training" in str(exc), exc  # swift pt / megatron pt
        return
    spec, problems = result.parse()
    if spec is None:
        # each names the flag or variable, and why it cannot be taken
        assert problems and all(p.field.startswith("--") or p.field.isupper() for p in problems), problems
        assert all("not supported" in p.message or "not set in the pasted text" in p.message for p in problems), problems
        return
    refused = {(p.field, p.message) for p in capabilities.unsupported(spec)}
    model = find_model_config(spec.model)  # the bundled configs know these models' shapes
    if model is not None:  # e.g. LoRA on the experts under EP: refused naming what does not run
        refused |= {(p.field, p.message) for p in capabilities.ep_model_problems(
            spec, model.is_moe, model.num_experts, model.tie_word_embeddings, adapts_stacked_params(spec, model))}
    found = errors(validate(spec, example_cluster(spec)))
    assert [p for p in found if (p.field, p.message) not in refused] == [], (name, result.notes)
    # What the job leaves out of the command is named, never dropped without a word.
    given = {token[2:].split("=")[0] for token in shlex.split(text.replace("\\\n", " ")) if token.startswith("--")}
    assert given <= ({flag for flag in given if canonical_key(flag) in result.spec}
                     | {flag for flag in given if any(f"--{flag}" in line for line in
                                                        result.ignored + result.notes + result.defaults)}
                     | HANDLED_ELSEWHERE), (name, result.ignored)


# Flags the import turns into other fields (megatron's names, the train type's three names,
# save_total_limit's "no limit"): their values are asserted in the tests above.
HANDLED_ELSEWHERE = {"train_type", "tuner_type", "sft_type", "load", "train_iters", "max_epochs", "save", "save_interval",
                     "log_interval", "lr_warmup_fraction", "global_batch_size", "lr_warmup_iters", "use_flash_attn",
                     "attention_backend", "micro_batch_size", "lr", "nproc_per_node", "nnodes", "node_rank",
                     "master_addr", "master_port", "hostfile", "recompute_granularity", "sequence_parallel"}


def test_an_moe_command_keeps_its_moe_flags_and_gets_the_engine_ep_runs_on():
    """megatron sft's MoE flags land on the job's fields (the aux loss by either name, ETP), EP is
    given FSDP2 and MoE LoRA no dropout, each with a note; nothing of it is dropped without a word."""
    result = import_command("NPROC_PER_NODE=8 megatron sft --load Qwen/Qwen3-30B-A3B --dataset d.jsonl "
                            "--expert_model_parallel_size 2 --expert_tensor_parallel_size 1 "
                            "--moe_aux_loss_coeff 1e-3 --train_iters 10 --train_type lora --target_modules all-linear")
    spec, problems = result.parse()
    assert problems == [] and (spec.router_aux_loss_coef, spec.expert_tensor_parallel_size) == (1e-3, 1)
    assert (spec.fsdp, spec.lora_dropout) == ("full_shard", 0)
    assert any(n.startswith("fsdp full_shard: chosen for you, expert_model_parallel_size > 1") for n in result.notes)
    assert any(n.startswith("lora_dropout 0 (was 0.05)") for n in result.notes)
    swift = import_command("swift sft --model Qwen/Qwen3-30B-A3B --dataset d.jsonl --router_aux_loss_coef 0.01")
    assert swift.parse()[0].router_aux_loss_coef == 0.01


@pytest.mark.parametrize("text,field,message", [
    ("swift sft --model m --dataset d.jsonl --train_type adalora", "--train_type",
     "adalora is not supported: swift-studio trains 'lora'"),
    ("NNODES=$WORLD_SIZE NPROC_PER_NODE=8 swift sft --model m --dataset d.jsonl", "NNODES",
     "$WORLD_SIZE: $WORLD_SIZE is not set in the pasted text"),
    ("swift sft --model m --dataset d.jsonl --max_length $MAXLEN", "--max_length", "$MAXLEN is not set"),
])
def test_what_cannot_run_is_refused_naming_it(text, field, message):
    spec, problems = import_command(text).parse()
    assert spec is None and [p.field for p in problems] == [field] and message in problems[0].message, problems


def test_a_dollar_in_free_text_is_the_users_text():
    spec, problems = import_command("swift sft --model m --dataset d.jsonl --system 'Prices are in $USD.'").parse()
    assert problems == [] and spec.system == "Prices are in $USD."


def flags_of(section: str) -> list[str]:
    """The flags docs/msswift-flags.md lists under the heading that starts with `section`."""
    text = (ROOT / "docs" / "msswift-flags.md").read_text()
    start = text.index(f"## {section} (")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end > 0 else len(text)]
    count = int(re.search(r"\((\d+)\)", body.splitlines()[0]).group(1))
    flags = re.findall(r"`([A-Za-z0-9_]+)`", body.split("\n\n")[-1])
    assert len(flags) == count, (section, len(flags), count)
    return flags


@pytest.mark.parametrize("command,honoured,not_honoured", [
    ("swift sft --max_steps 20", ["`swift sft`: honoured"], ["`swift sft`: not honoured"]),
    ("megatron sft --train_iters 20", ["`megatron sft`: honoured beyond those"],
     ["`megatron sft`: not honoured beyond those"]),
    ("swift rlhf --max_steps 20", ["`swift sft`: honoured", "`swift rlhf`: honoured beyond `swift sft`'s"],
     ["`swift rlhf`: not honoured beyond `swift sft`'s"]),
])
def test_the_flag_list_in_the_docs_is_what_the_import_does(command, honoured, not_honoured):
    """docs/msswift-flags.md (every flag of ms-swift 4.5.2's parsers) is a promise: each flag it
    calls not honoured comes back as ignored, each it calls honoured does not."""
    def ignored(flag: str) -> bool:
        result = import_command(f"{command} --model m --dataset d.jsonl --{flag} 2")
        return any(entry.split()[0] == f"--{flag}" for entry in result.ignored)

    wrong = [f for section in honoured for f in flags_of(section) if ignored(f)]
    wrong += [f for section in not_honoured for f in flags_of(section) if not ignored(f)]
    assert wrong == [], wrong


def test_a_vision_language_command_keeps_its_freezes_and_image_size():
    """ms-swift's Qwen2.5-VL example: the freezes and --max_pixels become the job's fields, and its
    MAX_PIXELS environment variable (which ms-swift's Qwen-VL templates read) max_pixels where no flag sets it."""
    spec, result = imported("""MAX_PIXELS=1003520 CUDA_VISIBLE_DEVICES=0 swift sft --model Qwen/Qwen2.5-VL-7B-Instruct \\
        --dataset AI-ModelScope/LaTeX_OCR#20000 --train_type lora --freeze_vit true --freeze_aligner false \\
        --torch_dtype bfloat16""")
    assert (spec.freeze_vit, spec.freeze_aligner, spec.max_pixels, spec.env) == (True, False, 1003520,
                                                                              {"CUDA_VISIBLE_DEVICES": "0"})
    assert "MAX_PIXELS=1003520 -> max_pixels (a --max_pixels flag takes precedence)" in result.notes
    spec, _ = imported("MAX_PIXELS=1003520 swift sft --model Qwen/Qwen2.5-VL-7B-Instruct --dataset d.jsonl "
                       "--max_pixels 602112")
    assert spec.max_pixels == 602112


def test_a_video_command_keeps_its_frame_bounds():
    """ms-swift's video examples set VIDEO_MAX_PIXELS and FPS_MAX_FRAMES (its Qwen-VL templates read them)
    and VIDEO_SEGMENTS (InternVL's): they become video_max_pixels, fps_max_frames and video_segments; a value that is not a number stays an environment variable."""
    spec, result = imported("""VIDEO_MAX_PIXELS=50176 FPS_MAX_FRAMES=12 MAX_PIXELS=1003520 swift sft \\
        --model Qwen/Qwen2.5-VL-7B-Instruct --dataset swift/VideoChatGPT:all --train_type lora""")
    assert (spec.video_max_pixels, spec.fps_max_frames, spec.max_pixels) == (50176, 12, 1003520)
    assert {"VIDEO_MAX_PIXELS=50176 -> video_max_pixels", "FPS_MAX_FRAMES=12 -> fps_max_frames"} <= set(result.notes)
    # InternVL's count of frames (its ms-swift template reads VIDEO_SEGMENTS)
    spec, result = imported("VIDEO_SEGMENTS=16 swift sft --model OpenGVLab/InternVL3-1B-hf --dataset d.jsonl")
    assert spec.video_segments == 16 and "VIDEO_SEGMENTS=16 -> video_segments" in result.notes
    spec, _ = imported("FPS_MAX_FRAMES=many swift sft --model Qwen/Qwen2.5-VL-7B-Instruct --dataset d.jsonl")
    assert spec.fps_max_frames is None and spec.env == {"FPS_MAX_FRAMES": "many"}
    # the ones the worker does not honour are named so, not passed on as if they were
    spec, result = imported("FPS=4 VIDEO_MIN_PIXELS=3136 swift sft --model Qwen/Qwen2.5-VL-7B-Instruct --dataset d.jsonl")
    assert spec.env == {} and [i.split(":")[0] for i in result.ignored] == ["FPS=4", "VIDEO_MIN_PIXELS=3136"]
