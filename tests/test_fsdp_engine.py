"""The FSDP2 engine's layout, in one gloo process on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from backend.job.capabilities import FsdpPlan
from backend.job.spec import JobSpec
from launcher.dist import Dist
from launcher.engines.fsdp import FSDPEngine
from launcher.model import decoder_layers


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield Dist(0, 1, 0, torch.device("cpu"), None)
    dist.destroy_process_group()


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("reshard", [True, False])
def test_full_shard_keeps_only_the_last_layer_gathered_for_backward(one_rank, reshard):
    model = tiny_llama()
    layers = decoder_layers(model)  # before fully_shard renames their classes
    spec = JobSpec(model="m", dataset=["d.jsonl"], torch_dtype="float32")
    engine = FSDPEngine(model, spec, one_rank, total_steps=1, plan=FsdpPlan(False, reshard, False))
    ids = torch.randint(0, 64, (2, 8))
    loss = engine.model(input_ids=ids, labels=ids).loss
    sharded = [isinstance(layer.mlp.up_proj.weight, DTensor) for layer in layers]
    # Backward needs the last layer at once; re-gathering it would only cost a collective.
    assert sharded == ([True, True, False] if reshard else [False, False, False])
    loss.backward()
    assert torch.isfinite(engine.step())


def test_no_optimizer_group_mixes_dtensors_and_plain_tensors(one_rank):
    """CUDA's fused AdamW takes a group in one call and refuses DTensors beside plain tensors: LoRA
    under TP failed so on an H100 (the adapters of a sharded layer are DTensors on one side only).
    Each group is one kind, split as before by rate and decay."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from launcher.engines.base import param_groups

    model = torch.nn.Module()
    model.lora_a = torch.nn.Parameter(torch.ones(4, 4))
    model.lora_b = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)]))
    model.norm = torch.nn.Parameter(torch.ones(4))
    groups = param_groups(model, JobSpec(model="m", dataset=["d.jsonl"], weight_decay=0.1))
    assert [[isinstance(p, DTensor) for p in g["params"]] for g in groups] == [[False], [True], [False]]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0] and all("lr" not in g for g in groups)
