"""Representative ms-swift command lines, written after reading ms-swift's own example scripts.

Pinned to tag v3.12.6 (commit 8773ecd08ef075a3c9b889ca967cd94e9c308fbd), the last 3.x release: it is
the newest commit that accepts the 3.x names these lines use (`--train_type`, and on the Megatron side
`--max_epochs`, `--save`, `--save_interval`, `--eval_interval`, `--num_workers`, `--load_safetensors`).
On main (4.6.0.dev0, 3602360a562313afbf2ef6065fdf61f271a2c5b9) `--train_type` is `--tuner_type`, and
Megatron-SWIFT took `--num_train_epochs`, `--output_dir`, `--save_steps`, `--eval_steps` and
`--dataloader_num_workers` instead, so these lines are for 3.12.

Every path in the second field exists at the pinned commit. The commands are paraphrases with
changed values, not copies; flags and values are ones ms-swift 3.12.6 accepts (swift/llm/argument/,
swift/trainers/arguments.py, swift/megatron/argument/megatron_args.py).

Each entry: (id, example path(s) it is modelled on, command text, what it exercises).
"""

PINNED = "modelscope/ms-swift@8773ecd08ef075a3c9b889ca967cd94e9c308fbd"

EXAMPLES = [
    # ---------------------------------------------------------------- swift sft: single GPU / DDP
    ("single-gpu-lora-selfcog",
     "examples/train/lora_sft.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#500' \
              'AI-ModelScope/alpaca-gpt4-data-zh#500' \
              'swift/self-cognition#500' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --lora_dropout 0.05 \
    --target_modules all-linear \
    --gradient_accumulation_steps 16 \
    --eval_steps 50 \
    --save_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataset_num_proc 4 \
    --dataloader_num_workers 4 \
    --model_author 魔搭 ModelScope \
    --model_name 小黄 'Xiao Huang'""",
     "single-GPU LoRA, multi-dataset with #N sampling, bilingual self-cognition lists"),

    ("ddp-lora",
     "examples/train/multi-gpu/ddp/train.sh",
     r"""nproc_per_node=4

CUDA_VISIBLE_DEVICES=0,1,2,3 \
NPROC_PER_NODE=$nproc_per_node \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --torch_dtype bfloat16 \
    --dataset 'swift/self-cognition#1000' \
              'AI-ModelScope/alpaca-gpt4-data-en#2000' \
    --num_train_epochs 2 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 2 \
    --learning_rate 1e-4 \
    --lora_rank 16 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \
    --gradient_checkpointing_kwargs '{"use_reentrant": false}' \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 3 \
    --logging_steps 10 \
    --max_length 4096 \
    --output_dir output/ddp \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --model_author swift \
    --model_name swift-robot""",
     "4-GPU DDP LoRA, shell var + $(expr) accumulation, gradient_checkpointing_kwargs JSON"),

    # ---------------------------------------------------------------- DeepSpeed
    ("zero2-lora",
     "examples/train/multi-gpu/deepspeed/train_zero2.sh",
     r"""nproc_per_node=4

CUDA_VISIBLE_DEVICES=0,1,2,3 \
NPROC_PER_NODE=$nproc_per_node \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'swift/self-cognition#1000' \
              'AI-ModelScope/alpaca-gpt4-data-zh#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --report_to tensorboard wandb \
    --model_author swift \
    --model_name swift-robot \
    --deepspeed zero2""",
     "DeepSpeed ZeRO-2 LoRA on 4 GPUs, report_to as a list"),

    ("zero3-full",
     "examples/train/multi-gpu/deepspeed/train_zero3.sh examples/train/full/train.sh",
     r"""NPROC_PER_NODE=8 \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#5000' \
              'AI-ModelScope/alpaca-gpt4-data-zh#5000' \
              'swift/self-cognition#500' \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 2 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 2 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps 2 \
    --gradient_checkpointing true \
    --eval_steps 200 \
    --save_steps 200 \
    --save_total_limit 2 \
    --save_only_model true \
    --logging_steps 5 \
    --max_length 4096 \
    --output_dir output/Qwen2.5-7B-full \
    --system 'You are a helpful assistant.' \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 8 \
    --model_author swift \
    --model_name swift-robot \
    --deepspeed zero3""",
     "DeepSpeed ZeRO-3 full fine-tune on 8 GPUs"),

    ("zero3-offload-lora-72b",
     "examples/train/sequence_parallel/sequence_parallel_512k.sh examples/train/multi-gpu/deepspeed/train_zero3.sh",
     r"""NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift sft \
    --model Qwen/Qwen2.5-72B-Instruct \
    --train_type lora \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#2000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 4 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 4096 \
    --output_dir output/Qwen2.5-72B-lora \
    --warmup_ratio 0.05 \
    --deepspeed zero3_offload""",
     "ZeRO-3 with CPU offload, 72B LoRA on 4 GPUs"),

    # ---------------------------------------------------------------- FSDP
    ("fsdp2-flag-lora",
     "examples/train/multi-gpu/fsdp2_lora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0,1 \
NPROC_PER_NODE=2 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'swift/self-cognition#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_checkpointing false \
    --weight_decay 0.1 \
    --gradient_accumulation_steps 8 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --model_author swift \
    --model_name swift-robot \
    --fsdp fsdp2""",
     "FSDP2 through --fsdp preset (swift>=3.12), gradient checkpointing off"),

    ("fsdp-accelerate-config",
     "examples/train/multi-gpu/fsdp2_lora/train.sh examples/train/multi-gpu/fsdp2_lora/fsdp2.json",
     r"""nproc_per_node=2

CUDA_VISIBLE_DEVICES=0,1 \
accelerate launch --config_file "./examples/train/multi-gpu/fsdp2_lora/fsdp2.json" \
    swift/cli/sft.py \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 2 \
    --learning_rate 2e-4 \
    --lora_rank 16 \
    --lora_alpha 32 \
    --gradient_checkpointing false \
    --target_modules all-linear \
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \
    --save_steps 100 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output/fsdp""",
     "FSDP via an accelerate config file, sft.py launched by accelerate"),

    # ---------------------------------------------------------------- QLoRA
    ("qlora-bnb-4bit",
     "examples/train/qlora/bnb/train.sh examples/train/tuners/qlora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#1000' \
              'swift/self-cognition#500' \
    --torch_dtype bfloat16 \
    --quant_method bnb \
    --quant_bits 4 \
    --bnb_4bit_compute_dtype bfloat16 \
    --bnb_4bit_quant_type nf4 \
    --bnb_4bit_use_double_quant true \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 16 \
    --save_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output/qlora \
    --model_author swift \
    --model_name swift-robot""",
     "4-bit bitsandbytes QLoRA (nf4, double quant) on one GPU"),

    # ---------------------------------------------------------------- multi-node
    ("multinode-env-node0",
     "examples/train/multi-node/swift/train_node1.sh",
     r"""nnodes=2
nproc_per_node=8

CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
NNODES=$nnodes \
NODE_RANK=0 \
MASTER_ADDR=10.0.0.1 \
MASTER_PORT=29500 \
NPROC_PER_NODE=$nproc_per_node \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#20000' \
              'AI-ModelScope/alpaca-gpt4-data-zh#20000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps $(expr 64 / $nproc_per_node / $nnodes) \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 8192 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --deepspeed zero2""",
     "2 nodes x 8 GPUs via NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT env, full + ZeRO-2"),

    ("multinode-torchrun-node1",
     "examples/train/multi-node/torchrun/train_node2.sh",
     r"""nnodes=2
nproc_per_node=8

CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
torchrun \
    --master_port 29500 \
    --nproc_per_node=$nproc_per_node \
    --nnodes=$nnodes \
    --node_rank=1 \
    --master_addr=10.0.0.1 \
    swift/cli/sft.py \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#20000' \
              'AI-ModelScope/alpaca-gpt4-data-zh#20000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps $(expr 64 / $nproc_per_node / $nnodes) \
    --eval_steps 100 \
    --save_steps 100 \
    --logging_steps 5 \
    --max_length 8192 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --deepspeed zero3""",
     "second node of a torchrun launch of swift/cli/sft.py, full + ZeRO-3"),

    ("multinode-deepspeed-hostfile",
     "examples/train/multi-node/deepspeed/train.sh",
     r"""deepspeed --hostfile=./examples/train/multi-node/deepspeed/host.txt \
    swift/cli/sft.py \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --torch_dtype bfloat16 \
    --dataset 'swift/self-cognition#1000' \
    --load_from_cache_file true \
    --num_train_epochs 1 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --learning_rate 1e-4 \
    --gradient_accumulation_steps 4 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --model_author swift \
    --model_name swift-robot \
    --deepspeed zero2""",
     "multi-node through the deepspeed launcher and a hostfile"),

    # ---------------------------------------------------------------- Ulysses sequence parallel
    ("ulysses-ddp-lora",
     "examples/train/sequence_parallel/sequence_parallel.sh",
     r"""NPROC_PER_NODE=4 \
CELOSS_PARALLEL_SIZE=2048 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --dataset 'AI-ModelScope/LongAlpaca-12k' \
    --load_from_cache_file true \
    --train_type lora \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 1 \
    --target_modules all-linear \
    --gradient_accumulation_steps 8 \
    --save_total_limit 2 \
    --save_only_model true \
    --save_steps 50 \
    --max_length 32768 \
    --warmup_ratio 0.05 \
    --attn_impl flash_attn \
    --sequence_parallel_size 4 \
    --logging_steps 1 \
    --use_logits_to_keep false \
    --padding_free true""",
     "Ulysses sequence parallel (size 4) without DeepSpeed, padding_free, 32K"),

    ("ulysses-zero3-full",
     "examples/train/sequence_parallel/sequence_parallel_512k.sh",
     r"""NPROC_PER_NODE=8 \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset 'AI-ModelScope/LongAlpaca-12k' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-5 \
    --gradient_accumulation_steps 4 \
    --packing true \
    --max_length 32768 \
    --eval_steps 200 \
    --save_steps 200 \
    --logging_steps 5 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 8 \
    --dataset_num_proc 8 \
    --save_total_limit 2 \
    --save_only_model true \
    --use_liger_kernel true \
    --deepspeed zero3 \
    --attn_impl flash_attn \
    --sequence_parallel_size 4""",
     "Ulysses (size 4, so DP 2) with ZeRO-3, packing and liger kernel"),

    # ---------------------------------------------------------------- packing / padding_free / liger / streaming
    ("packing-lora",
     "examples/train/packing/llm.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --packing true \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#2000' \
              'swift/self-cognition#500' \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 3 \
    --attn_impl flash_attn \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 4 \
    --eval_steps 50 \
    --save_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 4096 \
    --output_dir output \
    --dataset_num_proc 4 \
    --model_author swift \
    --model_name swift-robot""",
     "single-GPU LoRA with packing (needs flash_attn)"),

    ("padding-free-liger-full",
     "examples/train/padding_free/sft.sh examples/train/liger/sft.sh examples/train/packing/liger_kernel.sh",
     r"""NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift sft \
    --model Qwen/Qwen2.5-7B \
    --train_type full \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT#20000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --per_device_train_batch_size 8 \
    --per_device_eval_batch_size 8 \
    --learning_rate 1e-5 \
    --num_train_epochs 3 \
    --gradient_accumulation_steps 1 \
    --eval_steps 200 \
    --save_steps 200 \
    --logging_steps 5 \
    --max_length 8192 \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 8 \
    --dataset_num_proc 8 \
    --save_total_limit 2 \
    --save_only_model true \
    --output_dir output/Qwen2.5-7B \
    --deepspeed zero3 \
    --use_liger_kernel true \
    --attn_impl flash_attn \
    --padding_free true""",
     "full fine-tune with padding_free, liger kernel and ZeRO-3 on 4 GPUs"),

    ("streaming-packing-lora",
     "examples/train/streaming/streaming.sh examples/train/packing/streaming.sh",
     r"""NPROC_PER_NODE=2 \
CUDA_VISIBLE_DEVICES=0,1 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en' \
              'AI-ModelScope/alpaca-gpt4-data-zh' \
    --val_dataset 'swift/self-cognition#100' \
    --torch_dtype bfloat16 \
    --attn_impl flash_attn \
    --streaming true \
    --shuffle_buffer_size 1000 \
    --packing true \
    --max_steps 2000 \
    --max_epochs 3 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 8 \
    --eval_steps 200 \
    --save_steps 200 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 8192 \
    --output_dir output \
    --dataloader_num_workers 1 \
    --dataset_num_proc 8 \
    --deepspeed zero2""",
     "streaming datasets (needs --max_steps), --max_epochs cap, packing, separate val set"),

    ("local-data-rslora-swanlab",
     "examples/train/lora_sft.sh examples/train/tuners/lora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --use_rslora true \
    --dataset /data/sft/train.jsonl /data/sft/extra.jsonl \
    --split_dataset_ratio 0.05 \
    --dataset_num_proc 8 \
    --load_from_cache_file true \
    --torch_dtype bfloat16 \
    --num_train_epochs 3 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 2 \
    --learning_rate 5e-5 \
    --lora_rank 64 \
    --lora_alpha 128 \
    --lora_dropout 0.1 \
    --target_modules all-linear \
    --gradient_accumulation_steps 8 \
    --gradient_checkpointing true \
    --eval_steps 200 \
    --save_steps 200 \
    --save_total_limit 3 \
    --logging_steps 10 \
    --max_length 4096 \
    --output_dir /ckpt/qwen2.5-7b-rslora \
    --warmup_ratio 0.03 \
    --report_to swanlab \
    --swanlab_project qwen-sft \
    --swanlab_exp_name rslora-r64""",
     "local jsonl data, split_dataset_ratio, rsLoRA + lora_dropout, SwanLab logging"),

    # ---------------------------------------------------------------- other tuners
    ("dora-wandb",
     "examples/train/tuners/dora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --use_dora true \
    --dataset 'swift/self-cognition#1000' \
              'AI-ModelScope/alpaca-gpt4-data-en#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 16 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 16 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --report_to wandb \
    --model_author swift \
    --model_name swift-robot""",
     "DoRA (--use_dora) with Weights & Biases logging"),

    ("adalora",
     "examples/train/tuners/adalora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type adalora \
    --adalora_target_r 8 \
    --adalora_init_r 12 \
    --dataset 'swift/self-cognition#1000' \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --learning_rate 1e-4 \
    --gradient_accumulation_steps 16 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --model_author swift \
    --model_name swift-robot""",
     "AdaLoRA tuner (--train_type adalora)"),

    ("longlora",
     "examples/train/tuners/longlora/train.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model LLM-Research/Meta-Llama-3.1-8B-Instruct \
    --train_type longlora \
    --dataset 'AI-ModelScope/LongAlpaca-12k#2000' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --learning_rate 1e-4 \
    --attn_impl flash_attn \
    --gradient_accumulation_steps 16 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --eval_steps 100 \
    --save_steps 100 \
    --max_length 12000 \
    --save_total_limit 2 \
    --logging_steps 5""",
     "LongLoRA tuner (llama only) for long context"),

    # ---------------------------------------------------------------- swift sft MoE
    ("moe-lora-swift",
     "examples/train/moe/qwen3_moe.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift sft \
    --model Qwen/Qwen3-30B-A3B \
    --train_type lora \
    --dataset 'swift/Chinese-Qwen3-235B-2507-Distill-data-110k-SFT#2000' \
              'swift/self-cognition#1000' \
    --load_from_cache_file true \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --router_aux_loss_coef 1e-3 \
    --gradient_accumulation_steps 16 \
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
    --model_name swift-robot""",
     "MoE LoRA with router aux loss on Qwen3-30B-A3B"),

    # ---------------------------------------------------------------- megatron sft dense
    ("megatron-dense-tp2",
     "examples/megatron/sft.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=2 \
CUDA_VISIBLE_DEVICES=0,1 \
megatron sft \
    --model Qwen/Qwen2.5-7B-Instruct \
    --load_safetensors true \
    --save_safetensors true \
    --dataset 'AI-ModelScope/alpaca-gpt4-data-en#1000' \
              'AI-ModelScope/alpaca-gpt4-data-zh#1000' \
              'swift/self-cognition#500' \
    --tensor_model_parallel_size 2 \
    --sequence_parallel true \
    --micro_batch_size 8 \
    --global_batch_size 16 \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-6 \
    --max_epochs 2 \
    --save megatron_output/Qwen2.5-7B-Instruct \
    --save_interval 100 \
    --max_length 2048 \
    --system 'You are a helpful assistant.' \
    --num_workers 4 \
    --no_save_optim true \
    --no_save_rng true \
    --dataset_num_proc 4 \
    --model_author swift \
    --model_name swift-robot""",
     "Megatron full SFT, TP 2 + sequence parallel, full recompute, epochs"),

    ("megatron-72b-tp4-pp2",
     "examples/megatron/dense/72b_offload.sh examples/megatron/dense/qwen3_32b.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=8 \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
megatron sft \
    --model Qwen/Qwen2.5-72B-Instruct \
    --load_safetensors true \
    --save_safetensors true \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 4 \
    --pipeline_model_parallel_size 2 \
    --sequence_parallel true \
    --micro_batch_size 1 \
    --global_batch_size 16 \
    --packing true \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --max_epochs 2 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-6 \
    --save megatron_output/Qwen2.5-72B-Instruct \
    --eval_interval 500 \
    --save_interval 500 \
    --max_length 8192 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --optimizer_cpu_offload true \
    --use_precision_aware_optimizer true \
    --optimizer_offload_fraction 1 \
    --attention_backend flash""",
     "72B full SFT with TP 4 x PP 2, packing, optimizer CPU offload"),

    ("megatron-cp-long-iters",
     "examples/megatron/long_text.sh examples/megatron/pretrain.sh examples/megatron/rlhf/gkd/dense.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
megatron sft \
    --model Qwen/Qwen2.5-7B \
    --load_safetensors true \
    --save_safetensors true \
    --dataset 'ZhipuAI/LongWriter-6k' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 2 \
    --context_parallel_size 2 \
    --sequence_parallel true \
    --micro_batch_size 1 \
    --global_batch_size 8 \
    --packing true \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --train_iters 1000 \
    --eval_iters 50 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_iters 50 \
    --min_lr 1e-6 \
    --save megatron_output/Qwen2.5-7B-long \
    --eval_interval 200 \
    --save_interval 200 \
    --max_length 32768 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --attention_backend flash""",
     "32K context with TP 2 x CP 2, train_iters + lr_warmup_iters instead of epochs"),

    ("megatron-multinode-node1",
     "examples/megatron/multi-node/node2.sh examples/megatron/rlhf/gkd/dense.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
NNODES=2 \
NODE_RANK=1 \
MASTER_ADDR=10.0.0.1 \
MASTER_PORT=29500 \
NPROC_PER_NODE=8 \
megatron sft \
    --model Qwen/Qwen2.5-14B \
    --load_safetensors true \
    --save_safetensors true \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 4 \
    --micro_batch_size 1 \
    --global_batch_size 32 \
    --packing true \
    --recompute_granularity selective \
    --max_epochs 3 \
    --finetune \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-6 \
    --save megatron_output/Qwen2.5-14B \
    --eval_interval 200 \
    --save_interval 200 \
    --max_length 8192 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --sequence_parallel true \
    --attention_backend flash""",
     "Megatron on the second of 2 nodes via env, selective recompute, bare boolean flags"),

    # ---------------------------------------------------------------- megatron MoE
    ("megatron-moe-full-dlc",
     "examples/megatron/moe/qwen3_moe.sh examples/megatron/moe/moe.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NNODES=$WORLD_SIZE \
NODE_RANK=$RANK \
megatron sft \
    --model Qwen/Qwen3-30B-A3B \
    --load_safetensors true \
    --save_safetensors true \
    --dataset 'liucong/Chinese-DeepSeek-R1-Distill-data-110k-SFT' \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --pipeline_model_parallel_size 2 \
    --expert_model_parallel_size 8 \
    --moe_permute_fusion true \
    --moe_grouped_gemm true \
    --moe_shared_expert_overlap true \
    --moe_aux_loss_coeff 1e-3 \
    --micro_batch_size 1 \
    --global_batch_size 16 \
    --packing true \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --max_epochs 3 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-6 \
    --save megatron_output/Qwen3-30B-A3B \
    --eval_interval 200 \
    --save_interval 200 \
    --max_length 8192 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --sequence_parallel true \
    --attention_backend flash \
    --overlap_grad_reduce true \
    --overlap_param_gather true""",
     "MoE full SFT, PP 2 x EP 8, multi-node from platform env ($WORLD_SIZE/$RANK)"),

    ("megatron-moe-lora",
     "examples/megatron/lora/moe.sh examples/megatron/lora/qwen3_235b.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=8 \
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 \
megatron sft \
    --model Qwen/Qwen3-30B-A3B \
    --load_safetensors true \
    --save_safetensors true \
    --merge_lora false \
    --dataset 'swift/Qwen3-SFT-Mixin#2000' \
              'swift/self-cognition:empty_think#600' \
    --loss_scale ignore_empty_think \
    --train_type lora \
    --lora_rank 16 \
    --lora_alpha 32 \
    --lora_dropout 0.05 \
    --target_modules all-linear \
    --split_dataset_ratio 0.01 \
    --tensor_model_parallel_size 2 \
    --expert_tensor_parallel_size 1 \
    --expert_model_parallel_size 8 \
    --moe_permute_fusion true \
    --moe_grouped_gemm true \
    --moe_shared_expert_overlap true \
    --moe_aux_loss_coeff 1e-3 \
    --micro_batch_size 2 \
    --global_batch_size 16 \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --max_epochs 1 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 1e-4 \
    --lr_warmup_fraction 0.05 \
    --min_lr 1e-5 \
    --save megatron_output/Qwen3-30B-A3B-lora \
    --eval_interval 200 \
    --save_interval 200 \
    --max_length 4096 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --sequence_parallel true \
    --attention_backend flash \
    --report_to wandb \
    --wandb_project megatron-moe-lora \
    --model_author swift \
    --model_name swift-robot""",
     "MoE LoRA (all-linear) with TP 2, ETP 1, EP 8, wandb"),

    # ---------------------------------------------------------------- rlhf
    ("rlhf-dpo-lora",
     "examples/train/rlhf/dpo/lora.sh",
     r"""CUDA_VISIBLE_DEVICES=0 \
swift rlhf \
    --rlhf_type dpo \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset hjh0119/shareAI-Llama3-DPO-zh-en-emoji \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 5e-5 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps 16 \
    --eval_steps 50 \
    --save_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output/dpo \
    --warmup_ratio 0.05 \
    --beta 0.1 \
    --rpo_alpha 0.1 \
    --dataset_num_proc 4""",
     "swift rlhf DPO with LoRA on one GPU"),

    ("rlhf-dpo-full-zero3",
     "examples/train/rlhf/dpo/full.sh",
     r"""NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
swift rlhf \
    --rlhf_type dpo \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type full \
    --dataset hjh0119/shareAI-Llama3-DPO-zh-en-emoji \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 2 \
    --learning_rate 1e-6 \
    --gradient_accumulation_steps 2 \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 8192 \
    --output_dir output/dpo-full \
    --warmup_ratio 0.05 \
    --save_only_model true \
    --dataloader_num_workers 4 \
    --dataset_num_proc 4 \
    --deepspeed zero3 \
    --attn_impl flash_attn \
    --loss_type sigmoid \
    --padding_free true""",
     "swift rlhf DPO full parameters with ZeRO-3 and padding_free"),

    ("rlhf-orpo-lora-zero2",
     "examples/train/rlhf/orpo.sh",
     r"""nproc_per_node=2

CUDA_VISIBLE_DEVICES=0,1 \
NPROC_PER_NODE=$nproc_per_node \
swift rlhf \
    --rlhf_type orpo \
    --model Qwen/Qwen2.5-7B-Instruct \
    --train_type lora \
    --dataset hjh0119/shareAI-Llama3-DPO-zh-en-emoji \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype bfloat16 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 1 \
    --per_device_eval_batch_size 1 \
    --learning_rate 1e-4 \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --gradient_accumulation_steps $(expr 16 / $nproc_per_node) \
    --eval_steps 100 \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --max_length 2048 \
    --output_dir output \
    --warmup_ratio 0.05 \
    --dataloader_num_workers 4 \
    --deepspeed zero2 \
    --dataset_num_proc 4""",
     "swift rlhf ORPO with LoRA on ZeRO-2"),

    ("megatron-rlhf-dpo-moe-lora",
     "examples/megatron/lora/dpo.sh examples/megatron/rlhf/dpo/moe.sh",
     r"""PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' \
NPROC_PER_NODE=4 \
CUDA_VISIBLE_DEVICES=0,1,2,3 \
megatron rlhf \
    --rlhf_type dpo \
    --model Qwen/Qwen3-30B-A3B-Instruct-2507 \
    --load_safetensors true \
    --save_safetensors true \
    --merge_lora false \
    --dataset AI-ModelScope/orpo-dpo-mix-40k \
    --load_from_cache_file true \
    --train_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --split_dataset_ratio 0.01 \
    --expert_model_parallel_size 4 \
    --moe_permute_fusion true \
    --moe_grouped_gemm true \
    --moe_aux_loss_coeff 1e-3 \
    --micro_batch_size 4 \
    --global_batch_size 16 \
    --recompute_granularity full \
    --recompute_method uniform \
    --recompute_num_layers 1 \
    --max_epochs 1 \
    --finetune true \
    --cross_entropy_loss_fusion true \
    --lr 5e-5 \
    --lr_warmup_fraction 0.05 \
    --min_lr 5e-6 \
    --save megatron_output/Qwen3-30B-A3B-dpo \
    --eval_interval 100 \
    --save_interval 100 \
    --max_length 4096 \
    --num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim true \
    --no_save_rng true \
    --attention_backend flash \
    --beta 0.1 \
    --rpo_alpha 0.1 \
    --loss_type sigmoid""",
     "megatron rlhf DPO, MoE LoRA with EP 4"),
]
