"""The long-sequence paths (launcher/longseq.py): DeepSpeed's TiledMLP over each decoder layer's MLP
and transformers' activation checkpointing with offload give the same loss and gradients as the
plain model, on CPU; and the rules that say where they run."""
from __future__ import annotations

import pytest
import torch

from backend.job.capabilities import device_problems, unsupported, world_problems, zero_problems
from backend.job.spec import JobSpec
from launcher import longseq
from worker import ROOT, events, run_ok, write_run

DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#64"


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], **over})


def fields(problems) -> list[str]:
    return sorted(p.field for p in problems)


def test_tiles_are_about_hidden_size_and_exactly_what_chunk_makes():
    """TiledMLP chunks the row in forward and the flattened batch x row in backward, and marks the
    weights' gradients ready on the tile it counts as the last: both must make exactly n pieces."""
    for seq in range(1, 400):
        for hidden in (1, 3, 7, 16, 64, 100):
            n = longseq.tile_count(seq, hidden)
            for batch in (1, 2, 3, 4):
                assert len(torch.chunk(torch.zeros(batch, seq, 1), n, dim=-2)) == n, (seq, hidden)
                assert len(torch.chunk(torch.zeros(batch * seq), n)) == n, (seq, hidden, batch)
            # About hidden_size tokens a tile: never fewer tiles than asked for, at most one more.
            assert -(-seq // hidden) <= n <= -(-seq // hidden) + 1 or n == seq, (seq, hidden, n)
    assert longseq.tile_count(524288, 4096) == 128


def test_where_tiling_and_offload_are_refused_by_name():
    assert fields(unsupported(spec(tiled_mlp=True, activation_cpu_offload=True))) == []
    assert fields(unsupported(spec(activation_cpu_offload=True, gradient_checkpointing=False))) == [
        "activation_cpu_offload"]
    assert fields(unsupported(spec(tiled_mlp=True, torch_compile=True))) == ["tiled_mlp"]
    assert fields(unsupported(spec(tiled_mlp=True, tensor_model_parallel_size=2))) == ["tiled_mlp"]
    # Several ranks: the tiled MLP with DeepSpeed below ZeRO-3 only, offload never.
    assert fields(world_problems(spec(tiled_mlp=True, deepspeed="zero2"), 2)) == []
    assert fields(world_problems(spec(tiled_mlp=True), 2)) == ["tiled_mlp"]
    assert fields(world_problems(spec(tiled_mlp=True, fsdp="full_shard"), 1)) == []
    assert fields(zero_problems(spec(tiled_mlp=True, deepspeed="zero3"), 3)) == ["tiled_mlp"]
    assert fields(world_problems(spec(activation_cpu_offload=True, deepspeed="zero2"), 2)) == ["activation_cpu_offload"]
    cpu = device_problems(spec(activation_cpu_offload=True), {"n1": "cuda", "n2": "cpu"})
    assert fields(cpu) == ["activation_cpu_offload"] and "n2 is a CPU node" in cpu[0].message


def test_tiled_dropout_draws_the_forwards_masks_in_backward():
    """DeepSpeed's TiledMLP runs each tile again in backward without the forward's random state, so
    a dropout inside the tiled function gets another mask and a gradient that is not the forward's
    (when the first half fails, DeepSpeed keeps the state and TileRandomness can go). Through
    tile_mlps the masks are the forward's: the loss is w x (the kept values), its gradient loss / w."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.drop = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.w * self.drop(x)

    def loss_and_grad(tiled: bool) -> tuple[float, float]:
        torch.manual_seed(0)
        layer = torch.nn.Module()
        layer.mlp = Mlp()
        x = torch.ones(2, 64, 4, requires_grad=True)
        if tiled:
            longseq.tile_mlps([layer], hidden_size=16)
            loss = layer.mlp(x).sum()
            # Under checkpointing the layer is run again before backward, drawing the same masks.
            from torch.utils.checkpoint import checkpoint

            torch.manual_seed(0)
            checked = checkpoint(layer.mlp, x, use_reentrant=False).sum()
            assert checked.item() == loss.item()
            loss = loss + checked
        else:
            loss = TiledMLP.apply(lambda mlp, part: mlp.forward(part), layer.mlp, x, 4, [layer.mlp.w]).sum()
        loss.backward()
        return loss.item(), layer.mlp.w.grad.item()

    loss, grad = loss_and_grad(tiled=False)
    assert grad != pytest.approx(loss / 2.0)
    loss, grad = loss_and_grad(tiled=True)
    assert grad == pytest.approx(loss / 2.0)  # the plain and the checkpointed forward, both with their masks


def test_the_validator_refuses_tiling_a_mixture_of_experts(tmp_path):
    import json

    from backend.job.validate import validate

    config = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "vocab_size": 100, "head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    problems = validate(spec(model=str(tmp_path), tiled_mlp=True))
    assert "tiled_mlp" in fields(p for p in problems if p.severity == "error")


def grads_of(model_dir, train_type: str, rows: torch.Tensor, **fields) -> tuple[float, dict[str, torch.Tensor]]:
    from launcher.model import prepare

    job = spec(model=str(model_dir), train_type=train_type, torch_dtype="float32", lora_dropout=0.0,
               attn_impl="sdpa", **fields)
    torch.manual_seed(0)
    _, model = prepare(job)
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def host_offload(monkeypatch):
    """transformers pins the host copies, which needs CUDA: on CPU the same hooks copy unpinned,
    and every packed tensor is counted."""
    import transformers.modeling_utils as modeling_utils

    packed = []

    class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory=False, device_type=device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(t.shape) or pack(t)

    monkeypatch.setattr(modeling_utils, "save_on_cpu", CountingSaveOnCpu)
    return packed


@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_tiled_and_offloaded_give_the_plain_loss_and_gradients(tiny_families, host_offload, train_type):
    """A 200-token row through a 64-wide model: 4 MLP tiles; the checkpointed layer inputs go
    through the offload hooks (the count pins that torch's checkpoint saves them there)."""
    rows = torch.randint(3, 200, (2, 200), generator=torch.Generator().manual_seed(1))
    model = tiny_families["llama"]
    loss, grads = grads_of(model, train_type, rows, gradient_checkpointing=True)
    for variant in (dict(tiled_mlp=True), dict(activation_cpu_offload=True),
                    dict(tiled_mlp=True, activation_cpu_offload=True)):
        host_offload.clear()
        tiled_loss, tiled_grads = grads_of(model, train_type, rows, gradient_checkpointing=True, **variant)
        assert tiled_loss == pytest.approx(loss, rel=1e-6), variant
        assert tiled_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"{variant} {name}")
        if variant.get("activation_cpu_offload"):
            # Every layer's input, the whole row by hidden_size, went through the host copy.
            assert host_offload.count(torch.Size([2, 200, 64])) >= 2, host_offload


def test_tiled_mlp_without_checkpointing_matches_too(tiny_families):
    rows = torch.randint(3, 200, (1, 150), generator=torch.Generator().manual_seed(2))
    loss, grads = grads_of(tiny_families["mistral"], "full", rows, gradient_checkpointing=False)
    tiled_loss, tiled_grads = grads_of(tiny_families["mistral"], "full", rows, gradient_checkpointing=False,
                                       tiled_mlp=True)
    assert tiled_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.e2e
@pytest.mark.parametrize("sp", [1, 2])
def test_tiled_mlp_on_two_zero2_ranks_trains_like_untiled(tmp_path, tiny_model, sp):
    """DeepSpeed holds TiledMLP's gradients back until the last tile: 2 ranks tiled train as untiled,
    as two data-parallel ranks and as one Ulysses SP=2 group (each rank tiling its half of a row)."""
    job = dict(model=str(tiny_model), dataset=[DATA], max_length=256, per_device_train_batch_size=2,
               learning_rate=2e-3, max_steps=8, logging_steps=1, save_strategy="no", torch_dtype="float32",
               lora_dropout=0.0, attn_impl="sdpa", deepspeed="zero2", gradient_checkpointing=True,
               sequence_parallel_size=sp)
    runs = {}
    for name, extra in (("plain", {}), ("tiled", dict(tiled_mlp=True))):
        run_ok(write_run(tmp_path / name, **job, **extra), nproc=2, timeout=400)
        runs[name] = {e["step"]: e for e in events(tmp_path / name, 0, "train")}
    assert sorted(runs["tiled"]) == sorted(runs["plain"]) == list(range(1, 9))
    for step, plain in runs["plain"].items():
        for key in ("loss", "grad_norm"):
            assert runs["tiled"][step][key] == pytest.approx(plain[key], rel=2e-4), (step, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload copies GPU memory to pinned host memory")
def test_on_a_gpu_offload_frees_the_checkpointed_inputs_and_keeps_the_gradients(tmp_path):
    """A 1024-wide, 8-layer Llama on an 8192-token row: each layer's checkpointed input is 32 MiB
    in fp32. With offload, pinned host copies hold them: what the forward leaves on the GPU drops by
    most of the 8 x 32 MiB, and the gradients stay the same."""
    from worker import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", "llama", hidden_size=1024, intermediate_size=2048,
                                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    rows = torch.randint(3, 200, (1, 8192), generator=torch.Generator().manual_seed(3)).cuda()
    inputs_bytes = 8 * 8192 * 1024 * 4

    def run(**fields):
        from launcher.model import prepare

        job = spec(model=str(model_dir), train_type="full", torch_dtype="float32", attn_impl="sdpa",
                   gradient_checkpointing=True, **fields)
        torch.manual_seed(0)
        model = prepare(job)[1].cuda()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=rows, labels=rows).loss
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        loss.backward()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
        del model, loss
        torch.cuda.empty_cache()
        return kept, grads

    plain_kept, plain = run()
    offload_kept, offloaded = run(activation_cpu_offload=True)
    print(f"kept on the GPU after forward: {plain_kept / 2**20:.0f} MiB plain, {offload_kept / 2**20:.0f} MiB offloaded")
    assert plain_kept - offload_kept > 0.75 * inputs_bytes
    for name, grad in plain.items():
        torch.testing.assert_close(offloaded[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_estimate_moves_offloaded_inputs_to_host_memory_and_warns_when_it_is_short():
    """Llama-3.1-8B, LoRA, 128K tokens: offload moves layers x tokens x hidden x 2 bytes (32 GiB)
    from the GPU to the host; a node with less host memory than its ranks offload is warned about."""
    from backend.job.cluster import parse_hostfile_text
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import find_model_config
    from backend.job.validate import validate

    model = find_model_config("llama3.1-8b")
    long = dict(model="meta-llama/Llama-3.1-8B-Instruct", max_length=131072, lora_dropout=0.0,
                use_liger_kernel=True, nproc_per_node=1)
    plain, offloaded = (estimate_memory(spec(**long, activation_cpu_offload=on), model) for on in (False, True))
    inputs = 32 * 131072 * 4096 * 2 / 2**30
    assert offloaded.offloaded_gib == pytest.approx(inputs)
    assert plain.activations_gib - offloaded.activations_gib == pytest.approx(inputs)
    tiled = estimate_memory(spec(**long, tiled_mlp=True), model)
    assert tiled.activations_gib < plain.activations_gib - 10  # the SwiGLU's 4 x 14336 per token, less
    short = validate(spec(**long, activation_cpu_offload=True),
                     parse_hostfile_text("gpu1 slots=8 gpu_mem_gib=140 host_mem_gib=16\n"), model)
    warned = [p for p in short if p.field == "activation_cpu_offload"]
    assert len(warned) == 1 and warned[0].severity == "warning" and "16.0 GiB of gpu1" in warned[0].message
    for crafted in ("lots", "0", "-8", "inf", "nan"):
        with pytest.raises(ValueError, match=r"host_mem_gib must be a positive number of GiB of host memory"):
            parse_hostfile_text(f"gpu1 slots=8 host_mem_gib={crafted}\n")
    roomy = validate(spec(**long, activation_cpu_offload=True),
                     parse_hostfile_text("gpu1 slots=8 gpu_mem_gib=140 host_mem_gib=512\n"), model)
    assert not [p for p in roomy if p.field == "activation_cpu_offload"]


def test_nvme_offload_is_not_counted_as_host_memory():
    from backend.job.dsconfig import ZeroSettings
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import find_model_config

    model = find_model_config("llama3.1-8b")
    job = spec(model="meta-llama/Llama-3.1-8B-Instruct", train_type="full", deepspeed="zero3_offload")
    cpu = estimate_memory(job, model)
    nvme = estimate_memory(job, model, zero=ZeroSettings(3, "nvme", "nvme"))
    assert cpu.host_gib == cpu.offloaded_gib > 50
    assert nvme.offloaded_gib == cpu.offloaded_gib and nvme.host_gib == 0
