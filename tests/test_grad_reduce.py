"""Which dtype gradients travel in between ranks, per engine (grad_reduce_dtype)."""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from backend.job.spec import JobSpec
from launcher.engines.base import reduce_dtype
from launcher.engines.ddp import compress_hook


def spec(**kw) -> JobSpec:
    return JobSpec(model="m", dataset=["d.jsonl"], **kw)


def test_gradients_travel_in_the_compute_dtype_unless_fp32_is_asked_for():
    assert reduce_dtype(spec()) == torch.bfloat16
    assert reduce_dtype(spec(torch_dtype="float16")) == torch.float16
    assert reduce_dtype(spec(grad_reduce_dtype="float32")) == torch.float32
    assert reduce_dtype(spec(torch_dtype="float32")) == torch.float32


def test_ddp_compresses_with_torchs_hooks_where_the_backend_has_them():
    assert compress_hook(torch.bfloat16, "nccl") is default_hooks.bf16_compress_hook
    assert compress_hook(torch.bfloat16, "gloo") is None  # torch's bf16 hook refuses gloo
    assert compress_hook(torch.float16, "gloo") is default_hooks.fp16_compress_hook
    assert compress_hook(torch.float32, "nccl") is None
