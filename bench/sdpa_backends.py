"""Forward + backward time of torch's SDPA kernels (flash, cuDNN, memory-efficient) for the
attention shapes of the benchmark models, causal, bf16, with grouped-query heads passed both as
`enable_gqa=True` (what transformers does without a mask) and with K/V repeated.

    python bench/sdpa_backends.py          # on the GPU machine; one JSON line per case

TFLOP/s counts the causal half: 4·B·Hq·S²·D forward, 2.5× that backward. Each case also prints
the kernel torch picks by itself for the layout transformers hands it (heads transposed out of a
(batch, sequence, heads, dim) projection).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cases() -> dict[str, tuple[int, int, int, int, int]]:
    """name: (batch, query heads, kv heads, sequence, head dim) of the benchmark targets."""
    from bench.throughput import SHAPES

    out = {}
    for shape, seq, bsz in (("llama3.2-1b", 4096, 4), ("qwen2.5-1.5b", 2048, 8)):
        s = SHAPES[shape]
        out[f"{shape} {seq}x{bsz}"] = (bsz, s["num_attention_heads"], s["num_key_value_heads"], seq,
                                       s["hidden_size"] // s["num_attention_heads"])
    return out


def time_case(backend, shape, gqa: bool, repeats: int = 10) -> float:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    b, hq, hkv, s, d = shape
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)

    def once():
        kk, vv = (k, v) if gqa else (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
        out.backward(grad)

    with sdpa_kernel([backend]):
        for _ in range(3):
            once()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            once()
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def default_backend(shape) -> str:
    """The kernel SDPA chooses with no `sdpa_kernel` context, for transformers' strided q/k/v."""
    import torch
    from torch.nn.attention import SDPBackend

    b, hq, hkv, s, d = shape
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
    return SDPBackend(choice).name


def main() -> int:
    import torch
    from torch.nn.attention import SDPBackend

    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    for name, shape in cases().items():
        b, hq, _, s, d = shape
        flops = 4 * b * hq * s * s * d / 2 * 3.5
        print(json.dumps({"case": name, "default_backend": default_backend(shape)}), flush=True)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (True, False):
                row = {"case": name, "backend": backend.name, "enable_gqa": gqa}
                try:
                    seconds = time_case(backend, shape, gqa)
                    row.update(ms=round(seconds * 1e3, 3), tflops=round(flops / seconds / 1e12, 1))
                except RuntimeError as exc:  # the backend refuses this shape
                    row["error"] = str(exc).splitlines()[0][:200]
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
