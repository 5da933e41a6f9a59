"""Packing: samples share a row but never attend across each other (transformers builds a
block-diagonal mask from restarting position ids when no attention mask is passed)."""
from __future__ import annotations

import random

import pytest
import torch

from launcher.data import IGNORE, Sample, collate, pack, unpacked


def samples(lengths: list[int], vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(Sample(ids, [IGNORE] * (n // 2) + ids[n // 2:]))
    return out


def test_pack_layout():
    parts = samples([5, 4, 6, 3], 100)
    rows = pack(parts, max_length=10)
    # Best fit, longest first: 6 opens a row, 5 opens another, 4 fills the first, 3 goes with 5.
    assert [r.n_samples for r in rows] == [2, 2]
    assert rows[0].input_ids == parts[1].input_ids + parts[2].input_ids  # data order inside a row
    assert rows[0].position_ids == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    # The first token of every sample is never a target (it would be predicted from the previous sample).
    assert rows[1].labels[0] == IGNORE and rows[1].labels[5] == IGNORE
    batch = collate(rows, pad_id=0, packed=True, pad_to=10)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 10)
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]  # padding is its own block
    assert batch["labels"][1, -2:].tolist() == [IGNORE, IGNORE]


def test_pack_fills_rows_with_every_sample_once():
    rng = random.Random(0)
    lengths = [rng.randint(50, 2048) for _ in range(2000)]
    parts = [Sample([i] * n, [i] * n) for i, n in enumerate(lengths)]
    rows = pack(parts, max_length=2048)
    assert all(len(r.input_ids) <= 2048 for r in rows)
    assert sorted(t for r in rows for t in dict.fromkeys(r.input_ids)) == list(range(len(parts)))
    assert sum(r.n_samples for r in rows) == len(parts)
    fill = sum(lengths) / (2048 * len(rows))
    assert fill > 0.95, fill  # filling rows in data order gives ~0.75 here


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_packed_logits_equal_unpacked(tiny_model, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn, dtype=torch.float32).eval()
    parts = samples([7, 12, 5], model.config.vocab_size)
    row, = pack(parts, max_length=32)
    batch = collate([row], pad_id=0, packed=True, pad_to=32)
    with torch.no_grad():
        # use_cache=False as in training (the worker sets it): with a cache transformers skips
        # the packed-sequence detection and the samples would see each other.
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        start = 0
        for sample in parts:
            alone = model(input_ids=torch.tensor([sample.input_ids])).logits[0]
            assert torch.allclose(packed[start:start + len(sample)], alone, atol=1e-5), (attn, start)
            start += len(sample)
        # Control: the same row with one causal mask over everything does leak across samples.
        leaky = model(input_ids=batch["input_ids"]).logits[0]
        assert not torch.allclose(leaky[7:19], packed[7:19], atol=1e-3)


def test_packed_loss_equals_mean_of_unpacked_token_losses(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    parts = samples([9, 6, 11], model.config.vocab_size, seed=1)
    row, = pack(parts, max_length=32)
    packed = collate([row], pad_id=0, packed=True, pad_to=32)
    padded = collate(unpacked(parts), pad_id=0, packed=False)
    with torch.no_grad():
        packed_loss = model(**packed, use_cache=False).loss
        token_losses = []
        for i, sample in enumerate(parts):
            n = len(sample)
            logits = model(input_ids=padded["input_ids"][i:i + 1, :n]).logits[0, :-1]
            targets = padded["labels"][i, 1:n]
            keep = targets != IGNORE
            token_losses.append(torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="none"))
    assert torch.allclose(packed_loss, torch.cat(token_losses).mean(), atol=1e-5)
