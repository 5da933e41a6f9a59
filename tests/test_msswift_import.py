"""`swift-studio import`: the command lines of ms-swift's docs become specs that validate."""
from __future__ import annotations

import pytest
import yaml

from backend import capabilities
from backend.cluster import parse_hostfile_text
from backend.msswift import CommandError, import_command
from backend.spec import parse_spec
from backend.validate import errors, validate

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
    assert [p for p in found if (p.field, p.message) not in refused] == []


def test_single_node_zero2_lora():
    spec, result = imported(SINGLE_NODE_ZERO2_LORA)
    assert (spec.nproc_per_node, spec.nnodes, spec.deepspeed, spec.train_type) == (4, 1, "zero2", "lora")
    assert spec.dataset == ["AI-ModelScope/alpaca-gpt4-data-zh#500", "AI-ModelScope/alpaca-gpt4-data-en#500", "swift/self-cognition#500"]
    assert (spec.gradient_accumulation_steps, spec.lora_rank, spec.lora_alpha, spec.warmup_ratio) == (4, 8, 32, 0.05)
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert result.ignored == ["--eval_steps 50", "--system 'You are a helpful assistant.'", "--dataloader_num_workers 4",
                              "--model_author swift", "--model_name swift-robot"]
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
    assert {p.field for p in layout_errors} <= {"tensor_model_parallel_size", "pipeline_model_parallel_size"}


def test_ulysses_sequence_parallel():
    spec, result = imported(ULYSSES)
    assert (spec.sequence_parallel_size, spec.nproc_per_node, spec.max_length, spec.attn_impl) == (8, 8, 65536, "flash_attention_2")
    assert spec.env == {"CELOSS_PARALLEL_SIZE": "2048"}
    assert "--padding_free true" in result.ignored
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
    ("swift rlhf --model m", "not supervised fine-tuning"),
    ("swift sft --gradient_accumulation_steps $(expr 4 / 0)", "cannot evaluate"),
])
def test_unusable_commands(text, message):
    with pytest.raises(CommandError, match=message):
        import_command(text)
