"""Vision-language models (a tiny Qwen2.5-VL from a config): records with images tokenized with
each image's visual tokens, their problems named by file:line, the pixels reaching the model, what
is not run with them refused by name, and real training on DDP, FSDP2 and ZeRO-2 that exports."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.job.records import DataError, Persona, Record, sample_problems
from backend.job.spec import JobSpec
from backend.job.validate import errors, validate
from launcher.data import IGNORE, Batches, encode, one_per_row
from worker import (ROOT, assert_resumes_the_same, build_tiny_vl_model, colour_images, events, losses, planned,
                    run_workers, write_run)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "internvl"])
def tiny_vl(request, tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp(request.param), request.param)


def runs(images, sample) -> list[int]:
    """The token count of each image's placeholder run in a `Sample`, in order."""
    return [count for _, _, count in images.media("", sample.input_ids, sample.images)]


@pytest.fixture(scope="module")
def images(tiny_vl):
    from transformers import AutoConfig

    from launcher.vision import Images

    return Images(str(tiny_vl), AutoConfig.from_pretrained(tiny_vl))


def test_an_image_record_takes_one_token_per_visual_token_and_reaches_the_model(tmp_path, tiny_vl, images):
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    data = colour_images(tmp_path / "data", 4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    records = [Record(f"{data}:{i + 1}", json.loads(line), str(tmp_path / "data"))
               for i, line in enumerate(open(data))]
    samples = [encode(r, tokenizer, 96, Persona(images=True), images) for r in records]
    for sample, record in zip(samples, records):
        path = str(tmp_path / "data" / record.data["images"][0])
        assert sample.images == [path]
        counts = runs(images, sample)
        assert counts == [images.tokens(record.where, path)] and counts[0] > 1
        at = sample.input_ids.index(images.token_id)
        assert all(label == IGNORE for label in sample.labels[at:at + counts[0]])
        answer = tokenizer.decode([t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE])
        assert answer.startswith(record.data["messages"][1]["content"])
    if images.tiled:  # InternVL's tiles follow an image's aspect ratio: a wide one takes more of them
        from PIL import Image

        Image.new("RGB", (168, 56)).save(tmp_path / "wide.png")
        assert images.tokens("", str(tmp_path / "wide.png")) > runs(images, samples[0])[0]
        at = samples[0].input_ids.index(images.token_id)  # the run between the image's start and end tokens
        assert (samples[0].input_ids[at - 1], samples[0].input_ids[at + runs(images, samples[0])[0]]) \
            == images.bounds
    else:
        assert runs(images, samples[0]) != runs(images, samples[1])  # 56 and 84 px wide
    batches = Batches(lambda members: [samples[m] for m in members], one_per_row(4), 4, 1, 1, 0,
                      tokenizer.pad_token_id, False, 96)
    batches.media = images
    batch, _, _ = batches.batch_of([0, 1, 2, 3])
    counts = [runs(images, s)[0] for s in samples]
    if images.tiled:  # image tokens placed as text: positions as for text, no token types
        assert "position_ids" in batch and "mm_token_type_ids" not in batch
        assert batch["pixel_values"].shape[0] == sum(count // images.per_tile for count in counts)
    else:
        assert "position_ids" not in batch  # the model places its image tokens itself (its multimodal rope)
        assert batch["mm_token_type_ids"].tolist() == (batch["input_ids"] == images.token_id).int().tolist()
        grids = batch["image_grid_thw"]
        assert (grids.prod(-1) // images.merge ** 2).tolist() == counts
        assert batch["pixel_values"].shape[0] == grids.prod(-1).sum()
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    with torch.no_grad():
        seen = model(**batch).loss
        blank = model(**{**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}).loss
        # transformers 5.24 computes the multimodal rope only from the token types (as the processor
        # gives them): without, Qwen2.5-VL places image tokens as text, Qwen3-VL refuses
        try:
            unplaced = None if images.tiled else model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).loss
        except ValueError:
            unplaced = None
    assert abs(seen - blank) > 1e-4  # the pixels reach the loss
    assert unplaced is None or abs(seen - unplaced) > 1e-4  # and the image tokens their 2-D positions


def test_packed_image_records_give_every_sample_the_logits_it_has_alone(tmp_path, tiny_vl):
    """Packing (and padding_free's one row) with images: three image records of different sizes and a
    text record in one row, a padding tail after them; each sample's logits are those of its own padded
    row, so no sample sees another and every image token keeps its own multimodal position."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from launcher.data import collate, flattened, pack, unpacked
    from launcher.vision import Images

    data = colour_images(tmp_path / "data", 3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    records = [Record(f"{data}:{i + 1}", json.loads(line), str(tmp_path / "data")) for i, line in enumerate(open(data))]
    records.append(Record(f"{data}:4", {"messages": [{"role": "user", "content": "Name a colour."},
                                                     {"role": "assistant", "content": "green"}]}, str(tmp_path)))
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    media = Images(str(tiny_vl), AutoConfig.from_pretrained(tiny_vl))
    media.bind(model)
    samples = [encode(r, tokenizer, 200, Persona(images=True), media) for r in records]
    row, = pack(samples, max_length=sum(len(s) for s in samples) + 5)
    packed = collate([row], tokenizer.pad_token_id, True, pad_to=len(row.input_ids) + 5, media=media)
    alone = collate(unpacked(samples), tokenizer.pad_token_id, False, media=media)
    assert collate([flattened(unpacked(samples))], tokenizer.pad_token_id, True, media=media)["position_ids"].shape[0] \
        == (1 if media.tiled else 4)
    with torch.no_grad():
        together = model(**packed, use_cache=False).logits[0]
        apart = model(**alone, use_cache=False).logits
    at, order = 0, _data_order(row, samples)
    assert sorted(order) == [0, 1, 2, 3]
    for i in order:
        n = len(samples[i])
        assert torch.allclose(together[at:at + n], apart[i, :n], atol=2e-5), (records[i].where, media.tiled)
        at += n
    # the model's own positions for the packed row (no sample boundaries) would differ: the test can fail
    if not media.tiled:
        with torch.no_grad():
            unbounded = model(**{k: v for k, v in packed.items() if k != "position_ids"}, use_cache=False).logits[0]
        assert not torch.allclose(unbounded[:at], together[:at], atol=2e-5)


def _data_order(row, samples) -> list[int]:
    """Which samples a packed row holds, in its order (matched by their token ids)."""
    out, at = [], 0
    while at < len(row.input_ids):
        match = next((i for i, s in enumerate(samples) if i not in out and row.input_ids[at:at + len(s)] == s.input_ids),
                     None)
        if match is None:
            break
        out.append(match)
        at += len(samples[match])
    return out


def colour_pairs(directory: Path, count: int) -> str:
    """`colour_images` as preference pairs (ms-swift's messages + rejected_response): the image's colour
    chosen, the next colour's name rejected. The rejections go round in a circle, so no order of the
    names alone prefers every chosen answer: a model learns them from the pixels."""
    from worker import COLOURS

    names = list(COLOURS)
    data = colour_images(directory, count)
    records = [json.loads(line) for line in open(data)]
    for record in records:
        record["rejected_response"] = names[(names.index(record["messages"][1]["content"]) + 1) % len(names)]
    (directory / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(directory / "pairs.jsonl")


def test_a_preference_pair_with_an_image_has_it_in_both_rows_and_names_its_problems(tmp_path, tiny_vl, images):
    """A pair's images are in its prompt: both rows take each image's visual tokens and the micro-batch
    its pixels twice (chosen rows, then rejected ones); a tag in an answer or a count that does not match
    is named by file:line; a pair without images in a vision-language job is read as text."""
    from transformers import AutoTokenizer

    data = colour_pairs(tmp_path / "data", 2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    pairs = Persona(images=True, pairs=True)
    records = [Record(f"{data}:{i + 1}", json.loads(line), str(tmp_path / "data")) for i, line in enumerate(open(data))]
    encoded = [encode(r, tokenizer, 200, pairs, images) for r in records]
    for pair, record in zip(encoded, records):
        path = str(tmp_path / "data" / record.data["images"][0])
        for row in (pair.chosen, pair.rejected):
            assert row.images == [path] and runs(images, row) == [images.tokens(record.where, path)]
        answer = lambda row: tokenizer.decode([t for t, l in zip(row.input_ids, row.labels) if l != IGNORE])  # noqa: E731
        assert answer(pair.chosen).startswith(record.data["messages"][1]["content"])
        assert answer(pair.rejected).startswith(record.data["rejected_response"])
    batches = Batches(lambda members: [encoded[m] for m in members], one_per_row(2), 2, 1, 1, 0,
                      tokenizer.pad_token_id, False, 200, pairs=True)
    batches.media = images
    batch, _, _ = batches.batch_of([0, 1])
    assert batch["input_ids"].shape[0] == 4
    if not images.tiled:
        counts = [runs(images, p.chosen)[0] for p in encoded] * 2  # chosen rows, then rejected rows
        assert (batch["image_grid_thw"].prod(-1) // images.merge ** 2).tolist() == counts
    good = records[0].data
    bad = [{**good, "rejected_response": "<image>red"},
           {**good, "images": good["images"] * 2},
           {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "red"}],
            "rejected_response": "blue"}]
    (tmp_path / "data" / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    where = tmp_path / "data" / "bad.jsonl"
    assert sample_problems(str(where), 1 << 20, pairs)[:2] == [
        f"{where}:1: an <image> tag in the rejected answer: a pair's images go in its prompt, which both answers follow",
        f"{where}:2: 1 <image> tag(s) in its prompt and 2 image(s): each image needs a <image> tag where it goes"]
    text = encode(Record(f"{where}:3", bad[2], str(tmp_path)), tokenizer, 200, pairs, images)
    assert text.chosen.images == [] and runs(images, text.chosen) == []
    # padding_free: the micro-batch's chosen rows, then its rejected rows, end to end in one row, each
    # by its own positions: every row's logits are those it has padded
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.vision import Images

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    media = Images(str(tiny_vl), model.config)
    media.bind(model)
    flat = Batches(lambda members: [encoded[m] for m in members], one_per_row(2), 2, 1, 1, 0,
                   tokenizer.pad_token_id, False, 200, pairs=True, flat=True)
    flat.media = batches.media = media
    (padded, _, _), (together, _, _) = batches.batch_of([0, 1]), flat.batch_of([0, 1])
    with torch.no_grad():
        apart, joined = model(**padded, use_cache=False).logits, model(**together, use_cache=False).logits[0]
    at = 0
    for row, sample in enumerate([p.chosen for p in encoded] + [p.rejected for p in encoded]):
        n = len(sample.input_ids)
        assert torch.allclose(joined[at:at + n], apart[row, :n], atol=2e-5), row
        at += n


def test_image_records_name_their_problems_by_file_and_line(tmp_path, tiny_vl, images):
    from transformers import AutoTokenizer

    data = tmp_path / "data"
    good = json.loads(open(colour_images(data, 1)).readline())
    (data / "truncated.png").write_bytes((data / "0.png").read_bytes()[:60])
    (data / "text.png").write_text("not an image")
    from PIL import Image

    Image.new("RGB", (96, 64), (200, 30, 30)).save(data / "photo.jpg")
    (data / "half.jpg").write_bytes((data / "photo.jpg").read_bytes()[:300])  # its header whole, its pixels not
    Image.new("RGB", (600, 2)).save(data / "thin.png")
    bad = [{**good, "images": ["0.png", "0.png"]}, {**good, "images": ["missing.png"]},
           {**good, "images": ["truncated.png"]}, {**good, "images": ["text.png"]}, {**good, "images": "0.png"},
           {**good, "videos": ["clip.mp4"]}]
    (data / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    problems = sample_problems(str(data / "bad.jsonl"), 1 << 20, Persona(images=True))
    where = f"{data / 'bad.jsonl'}"
    assert problems[:3] == [
        f"{where}:1: 1 <image> tag(s) in its messages and 2 image(s): each image needs a <image> tag where it goes",
        f"{where}:2: image {data / 'missing.png'} not found (a relative path is read from the data file's directory)",
        f"{where}:3: image {data / 'truncated.png'} is not a whole image PIL can read " + problems[2].split("read ", 1)[1]]
    assert problems[3] == f"{where}: 3 more bad records among the 6 checked"
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    with pytest.raises(DataError, match=r"bad.jsonl:4: image .*text.png is not an image PIL can read"):
        encode(Record(f"{where}:4", bad[3], str(data)), tokenizer, 96, Persona(images=True), images)
    with pytest.raises(DataError, match=r":5: 'images' must be a list of image file paths"):
        encode(Record(f"{where}:5", bad[4], str(data)), tokenizer, 96, Persona(images=True), images)
    with pytest.raises(DataError, match=r":6: a multimodal record \('videos'\): this model's videos are not read yet"):
        encode(Record(f"{where}:6", bad[5], str(data)), tokenizer, 96, Persona(images=True), images)
    # an image inline (base64, as ms-swift takes them) reads as its file does; a bad one is named
    import base64

    inline = {**good, "images": ["data:image/png;base64," + base64.b64encode((data / "0.png").read_bytes()).decode()]}
    from_file = encode(Record(f"{where}:1", good, str(data)), tokenizer, 96, Persona(images=True), images)
    assert encode(Record(f"{where}:7", inline, str(data)), tokenizer, 96, Persona(images=True), images).input_ids == \
        from_file.input_ids
    with pytest.raises(DataError, match=r":8: image inline \(data: URI\) is not base64"):
        encode(Record(f"{where}:8", {**good, "images": ["data:image/png;base64,#!"]}, str(data)), tokenizer, 96,
               Persona(images=True), images)
    # what validation's sampled check and the worker both name: a JPEG cut short (PIL's verify() alone
    # passes it), a side over 200 times the other (the processor refuses it), a FIFO (a read would block),
    # tags without images, an image in an answer or after the last one
    import os

    os.mkfifo(data / "pipe.png")
    turns = [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "red"}]
    more = [{**good, "images": ["half.jpg"]}, {**good, "images": ["thin.png"]}, {**good, "images": ["pipe.png"]},
            {**good, "images": []}, {"messages": [turns[0], {"role": "assistant", "content": "<image>red"}],
                                     "images": ["0.png"]},
            {"messages": turns + [{"role": "user", "content": "<image>And this?"}], "images": ["0.png"]}]
    (data / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in more))
    named = [p.split(": ", 1)[1] for p in sample_problems(str(data / "more.jsonl"), 1 << 20, Persona(images=True))]
    assert named[0].startswith(f"image {data / 'half.jpg'} is not ") and "PIL can read" in named[0]
    assert named[1] == (f"image {data / 'thin.png'} is 600x2: a side over 200 times the other, which the model's "
                        "image processor refuses")
    assert named[2] == f"image {data / 'pipe.png'} is a FIFO (named pipe): reading it would wait for a writer"
    assert named[3] == "3 more bad records among the 6 checked"
    for i, message in ((3, r"1 <image> tag\(s\) in its messages and 0 image\(s\)"),
                       (4, r"an <image> tag in an assistant answer \(message 2\)"),
                       (5, r"an <image> tag after the last assistant answer \(message 3\)")):
        with pytest.raises(DataError, match=f":{i + 1}: {message}"):
            encode(Record(f"{where}:{i + 1}", more[i], str(data)), tokenizer, 96, Persona(images=True), images)
    if not images.tiled:
        with pytest.raises(DataError, match=r"thin.png: absolute aspect ratio must be smaller than 200"):
            encode(Record(f"{where}:2", more[1], str(data)), tokenizer, 96, Persona(images=True), images)
    else:  # InternVL's processor tiles any shape: validation takes it, the worker counts its tiles
        tiled = Persona(images=True, tiled=True)
        assert [p for p in sample_problems(str(data / "more.jsonl"), 1 << 20, tiled) if "thin.png" in p] == []
        assert images.tokens(where, str(data / "thin.png")) > images.per_tile
    # an image replaced by a larger one after tokenizing (the cache holds the old count) stops the run by path
    replaced = encode(Record(f"{where}:1", good, str(data)), tokenizer, 96, Persona(images=True), images)
    Image.new("RGB", (168, 168)).save(data / "0.png")
    found = images.media("", replaced.input_ids, replaced.images)
    with pytest.raises(DataError, match=r"image .*0.png is not the size it had when the data was tokenized"):
        images.pixels(found)
    # an image cut off by max_length would not match its pixels: the record is dropped (counted)
    assert encode(Record(f"{where}:1", good, str(data)), tokenizer, 12, Persona(images=True), images) is None


def test_lora_adapts_the_language_model_only_whatever_its_targets_are_named(tiny_vl):
    """'all-linear' and named targets alike: the vision tower's blocks have gate/up/down projections
    too, and LoRA stays off them (freeze_vit); with the tower or the aligner unfrozen, their linear
    layers get adapters too (not the patch embedding's convolution)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.model import add_lora
    from launcher.vision import vision_parts

    base = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    # GLM-4V's language model has one gate_up_proj where its tower has gate_proj and up_proj
    named = {n.rsplit(".", 1)[-1] for n, m in base.named_modules()
             if isinstance(m, torch.nn.Linear) and ".language_model." in n}
    for targets in (["all-linear"], ["gate_proj", "up_proj", "down_proj"]):
        model = add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32),
                         JobSpec(model="m", dataset=["d"], target_modules=targets))
        adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
        assert adapted and all(".language_model." in n for n in adapted), (targets, sorted(adapted)[:3])
        if targets != ["all-linear"]:
            assert {n.rsplit(".", 1)[-1] for n in adapted} == set(targets) & named
    # ms-swift's rule: the parts that train get adapters; every linear layer of them, nothing else
    vit, aligner, llm = vision_parts(base)
    linear = {part: {n for module in modules for n, m in base.named_modules()
                     if isinstance(m, torch.nn.Linear) and any(m is sub for sub in module.modules())}
              for part, modules in (("vit", vit), ("aligner", aligner), ("llm", llm[:1]))}
    assert linear["vit"] and linear["aligner"] and linear["llm"]
    for frozen, parts in ((dict(freeze_vit=False, freeze_aligner=False), ("vit", "aligner", "llm")),
                          (dict(freeze_llm=True, freeze_aligner=False), ("aligner",))):
        model = add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32),
                         JobSpec(model="m", dataset=["d"], **frozen))
        adapted = {n.split(".base_layer")[0].removeprefix("base_model.model.")
                   for n, m in model.named_modules() if n.endswith(".base_layer")}
        assert adapted == set().union(*(linear[part] for part in parts)), (frozen, sorted(adapted))


def test_torch_compile_compiles_the_language_models_layers_only(tiny_vl):
    """Every decoder layer of the language model, LoRA-wrapped or not, and no block of the vision
    tower (each batch brings it another patch count: a recompile each)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.model import add_lora, compiled_layers, decoder_layers
    from launcher.vision import vision_parts

    def load():
        return AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)

    for model in (load(), add_lora(load(), JobSpec(model="m", dataset=["d"]))):
        vit, _, llm = vision_parts(model)
        inside = lambda modules: {id(m) for part in modules for m in part.modules()}  # noqa: E731
        layers = compiled_layers(model)
        assert len(layers) == 2 and {id(layer) for layer in layers} <= inside(llm[:1])
        assert not {id(layer) for layer in layers} & inside(vit)
        assert len(decoder_layers(model)) > len(layers)  # the tower's blocks are decoder layers to FSDP2


def test_vit_lr_and_aligner_lr_put_the_tower_and_the_aligner_in_groups_of_their_own(tiny_vl):
    """ms-swift's optimizer groups: the vision tower at vit_lr, the aligner at aligner_lr, the rest at
    learning_rate (first: its rate is the one logged), each split by weight decay; nothing set: the
    usual two groups. DDP's wrapper is looked through."""
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.engines.base import param_groups
    from launcher.vision import vision_parts

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32)
    vit, aligner, llm = ([p for m in part for p in m.parameters()] for part in vision_parts(model))
    job = dict(model="m", dataset=["d"], train_type="full", learning_rate=1e-4, weight_decay=0.1)
    assert [len(g["params"]) for g in param_groups(model, JobSpec(**job))] == [
        sum(p.ndim >= 2 for p in model.parameters()), sum(p.ndim < 2 for p in model.parameters())]
    frozen = next(m for part in vision_parts(model)[0] for m in part.modules() if isinstance(m, torch.nn.Linear))
    frozen.requires_grad_(False)  # what trains only
    spec = JobSpec(**job, freeze_vit=False, vit_lr=1e-6, freeze_aligner=False, aligner_lr=1e-3)
    for holder in (model, torch.nn.ModuleDict({"module": model})):
        groups = param_groups(holder, spec)
        assert "lr" not in groups[0] and groups[0]["weight_decay"] == 0.1
        rate = {id(p): g.get("lr", spec.learning_rate) for g in groups for p in g["params"]}
        decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
        assert {rate[id(p)] for p in vit if p.requires_grad} == {1e-6}
        assert {rate[id(p)] for p in aligner} == {1e-3} and {rate[id(p)] for p in llm} == {1e-4}
        assert all(id(p) not in rate for p in frozen.parameters())
        assert all(decay[i] == (0.1 if p.ndim >= 2 else 0.0) for p in model.parameters() if (i := id(p)) in decay)


def test_a_vision_language_job_refuses_what_is_not_run_with_it_by_name(tmp_path, tiny_vl):
    data = colour_images(tmp_path / "data", 4)
    base = dict(model=str(tiny_vl), dataset=[data], nproc_per_node=2)

    def refused(**fields) -> dict[str, str]:
        return {p.field: p.message for p in errors(validate(JobSpec(**{**base, **fields})))}

    assert refused() == {}
    assert refused(train_type="full", fsdp="full_shard") == {} and refused(train_type="full", deepspeed="zero2") == {}
    assert refused(packing=True) == {} and refused(padding_free=True) == {}
    # streamed records are not read before launch: only where a micro-batch without an image is safe
    assert refused(streaming=True, max_steps=4) == {} and refused(streaming=True, max_steps=4, nproc_per_node=1,
                                                                  fsdp="full_shard") == {}
    for engine in ({"fsdp": "full_shard"}, {"train_type": "full"}, {"deepspeed": "zero3"}, {"freeze_vit": False}):
        assert refused(streaming=True, max_steps=4, **engine)["streaming"].startswith(
            "with a vision-language model on several ranks only where a micro-batch without an image is safe"), engine
    # transformers' TP plans split the language model, but Qwen3-VL's its embedding alone
    assert refused(tensor_model_parallel_size=2) == ({} if "qwen3_vl" not in str(tiny_vl) else {
        "tensor_model_parallel_size": "transformers' TP plan for qwen3_vl shards its embedding alone: every rank would "
                                      "hold and compute every layer; leave TP at 1"})
    assert refused(torch_compile=True) == {}
    assert "not with a vision-language model yet" in refused(deepspeed="zero2", sequence_parallel_size=2)[
        "sequence_parallel_size"]
    assert refused(freeze_vit=False) == {} and refused(freeze_llm=True, freeze_aligner=False) == {}
    assert "nothing trains" in refused(freeze_llm=True)["freeze_llm"]  # LoRA on no part
    assert "nothing trains" in refused(train_type="full", freeze_llm=True)["freeze_llm"]
    assert refused(vit_lr=1e-5)["vit_lr"].startswith("the vision tower is frozen (freeze_vit)")
    assert refused(train_type="full", aligner_lr=1e-5)["aligner_lr"].startswith("the aligner is frozen (freeze_aligner)")
    assert refused(train_type="full", freeze_vit=False, vit_lr=1e-5, freeze_aligner=False, aligner_lr=1e-4) == {}
    # InternVL's tiles have a fixed size: no pixel bound to set
    capped = refused(max_pixels=56 * 56)
    assert (capped["max_pixels"].startswith("internvl's image processor cuts images into tiles") if "internvl" in
            str(tiny_vl) else capped == {}), capped
    # videos' bounds: a family that reads no videos names them ignored (its records' videos are refused)
    family = json.loads((tiny_vl / "config.json").read_text())["model_type"]
    # (Qwen's bounds apply to Qwen's, InternVL's count of frames to InternVL's; each names the other's ignored)
    fields = ("video_max_pixels", "fps_max_frames", "video_segments")
    bounded = {p.field: p.message for p in validate(JobSpec(**{**base, **dict(zip(fields, (50176, 8, 4)))}))
               if p.field in fields}
    if family == "internvl":
        assert bounded == dict.fromkeys(fields[:2], "ignored: internvl reads video_segments frames of a video, each "
                                                    "one tile"), bounded
    elif family == "glm4v":
        assert bounded == dict.fromkeys(fields, "ignored: the worker reads videos with qwen2_vl, qwen2_5_vl, qwen3_vl, "
                                                "internvl only, not glm4v (its records' videos are refused)"), bounded
    else:
        assert bounded == {"video_segments": f"ignored: {family} samples a video's frames at 2 a second "
                                             "(fps_max_frames bounds them); video_segments is InternVL's"}, bounded
    # a text model's job names the image records it cannot read, by file:line
    text = [p.message for p in errors(validate(JobSpec(**{**base, "model": str(ROOT / "assets" / "demo" / "model")})))
            if p.field == "dataset[0]"][0]
    assert text.startswith(f"{data}:1: a multimodal record ('images'): the model is not a vision-language model")


def test_images_stored_in_a_datasets_image_column_read_as_their_files_do(tmp_path, tiny_vl, images, monkeypatch):
    """A parquet file written by `datasets` with an Image column (each image its {bytes, path}), and a
    hub dataset with one (`load_dataset` answers with the same rows here, their images decoded as the
    hub's loader gives them), tokenize as the same records with image files do; a damaged image's
    bytes are named by row."""
    import datasets
    from transformers import AutoTokenizer

    from backend.job.records import Source, positioned_records, record_images
    from launcher.tokenized import open_tokenized

    data = tmp_path / "data"
    path = colour_images(data, 4)
    rows = [json.loads(line) for line in open(path)]
    stored = datasets.Dataset.from_dict(
        {"messages": [r["messages"] for r in rows],
         "images": [[{"bytes": (data / r["images"][0]).read_bytes(), "path": None}] for r in rows]},
        features=datasets.Features({"messages": datasets.List({"role": datasets.Value("string"),
                                                               "content": datasets.Value("string")}),
                                    "images": datasets.List(datasets.Image())}))
    parquet = str(tmp_path / "train.parquet")
    stored.to_parquet(parquet)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: stored if name == "org/colours" else None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)

    def tokens(entry: str) -> list[list[int]]:
        table = open_tokenized(JobSpec(model=str(tiny_vl), dataset=[entry], max_length=96), tokenizer,
                               tmp_path / "cache", images).table
        return table.column("input_ids").to_pylist()

    assert tokens(parquet) == tokens("org/colours") == tokens(path)
    hub = [r for _, r in positioned_records(Source("org/colours"), 0, 1, 0, 1 << 20)]
    assert record_images(hub[0])[0].startswith("data:image/png;base64,")
    assert sample_problems(parquet, 1 << 20, Persona(images=True)) == []
    damaged = stored.cast_column("images", datasets.List(datasets.Image(decode=False))).map(
        lambda r, i: {"images": [{"bytes": r["images"][0]["bytes"][:60] if i == 2 else r["images"][0]["bytes"],
                                  "path": None}]}, with_indices=True)
    damaged.to_parquet(str(tmp_path / "damaged.parquet"))
    assert [p.split(": image ")[0] for p in sample_problems(str(tmp_path / "damaged.parquet"), 1 << 20,
                                                            Persona(images=True))] == [f"{tmp_path / 'damaged.parquet'}: row 3"]
    with pytest.raises(DataError, match=r"'images' must be a list of image file paths, data:image URIs or"):
        record_images(Record("x:1", {"images": [{"bytes": None, "path": None}]}))


def test_strict_off_skips_and_counts_the_records_it_cannot_use_and_names_the_first(tmp_path, tiny_vl, images):
    """ms-swift's --strict: on (swift-studio's default) the first bad record stops tokenizing by file:line;
    off, bad records are skipped, counted and named in the entry, the good ones train, and the
    images are decoded whole (a JPEG whose header is whole and pixels cut passes the header read)."""
    from PIL import Image
    from transformers import AutoTokenizer

    from launcher.tokenized import open_tokenized

    data = tmp_path / "data"
    good = [json.loads(line) for line in open(colour_images(data, 6))]
    import random

    noise = random.Random(0).randbytes(128 * 128 * 3)
    Image.frombytes("RGB", (128, 128), noise).save(data / "photo.jpg")
    whole = (data / "photo.jpg").read_bytes()
    (data / "half.jpg").write_bytes(whole[:len(whole) // 2])
    bad = {3: {**good[0], "images": ["half.jpg"]}, 5: {**good[0], "images": ["missing.png"]},
           7: {**good[0], "images": ["0.png", "0.png"]}, 9: {"images": ["0.png"]}}
    rows = good[:]
    for line, record in sorted(bad.items()):
        rows.insert(line - 1, record)
    path = data / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    spec = JobSpec(model=str(tiny_vl), dataset=[str(path)], max_length=96)
    with pytest.raises(DataError, match=rf"^{path}:5: image .*missing.png not found"):  # half.jpg's header reads
        open_tokenized(spec, tokenizer, tmp_path / "cache", images)
    loose = open_tokenized(spec.model_copy(update={"strict": False}), tokenizer, tmp_path / "cache", images)
    assert loose.skipped == 4 and [m.split(": ")[0] for m in loose.skipped_first] == [f"{path}:{n}" for n in bad]
    assert "half.jpg is not a whole image PIL can read" in loose.skipped_first[0]
    rows_kept, dropped = loose.shard(0, 1)
    assert (len(rows_kept), dropped) == (6, 0)
    assert [s.images for s in loose.samples(rows_kept)] == [[str(data / r["images"][0])] for r in good]
    # validation: the same records are a warning that says they will be skipped, not an error
    found = {p.field: p for p in validate(spec.model_copy(update={"strict": False}))}
    assert found["dataset[0]"].severity == "warning" and "strict is off: records like these are skipped" in \
        found["dataset[0]"].message and f"{path}:3:" in found["dataset[0]"].message
    assert errors(validate(spec))[0].message.startswith(f"{path}:3: image")


@pytest.fixture(scope="module")
def tiny_qwen25_vl(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("qwen2_5_vl-e2e"))


@pytest.mark.e2e
def test_a_vision_language_model_trains_on_images_on_every_data_parallel_engine_and_exports(tmp_path, tiny_qwen25_vl):
    """LoRA (the language model's linear layers; the tower and merger frozen) on two DDP ranks: the
    loss falls, packed too, and a resume from step 4 trains its losses; full fine-tuning of the language model (the merger at its own aligner_lr) on FSDP2, ZeRO-2 and ZeRO-3 trains DDP's losses
    (two ranks each, reading the same shards), as FSDP2 with padding_free does (ZeRO-2's resumed from step 2 too); the LoRA export loads with its image processor and, on an image record, has a
    lower loss than the base model."""
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.export import export

    data = colour_images(tmp_path / "data", 32)
    common = dict(model=str(tiny_qwen25_vl), dataset=[data], max_length=96, logging_steps=1, torch_dtype="float32",
                  lora_dropout=0.0, warmup_ratio=0.0, dataset_cache_dir=str(tmp_path / "cache"))
    # the LoRA run's data has two records it cannot use at its end: strict off skips and counts them
    skipping = tmp_path / "data" / "skipping.jsonl"
    (tmp_path / "data" / "cut.png").write_bytes((tmp_path / "data" / "0.png").read_bytes()[:60])
    skipping.write_text(open(data).read() + "".join(
        json.dumps({**json.loads(open(data).readline()), "images": [name]}) + "\n" for name in ("gone.png", "cut.png")))
    lora_job = dict(**{**common, "dataset": [str(skipping)]}, strict=False, train_type="lora",
                    per_device_train_batch_size=4, learning_rate=5e-2, max_steps=8, save_steps=4)
    lora = write_run(tmp_path / "lora", **lora_job)
    # the aligner in the optimizer at a rate that leaves it as it was (aligner_lr honoured on each engine)
    full = dict(**common, train_type="full", learning_rate=3e-3, max_steps=3, save_strategy="no", freeze_aligner=False,
                aligner_lr=1e-20)
    ddp = write_run(tmp_path / "ddp", **full, per_device_train_batch_size=2)
    fsdp, zero2, zero3 = tmp_path / "fsdp2", tmp_path / "zero2", tmp_path / "zero3"
    zero2_job = dict(**{**full, "save_strategy": "steps"}, save_steps=2, per_device_train_batch_size=2, deepspeed="zero2")
    # padding_free: a micro-batch's samples end to end in one row, each by its own multimodal positions
    # (and without gradient checkpointing, which every other run here has)
    padfree = tmp_path / "padding-free"
    packed = write_run(tmp_path / "packed", **common, train_type="lora", packing=True, per_device_train_batch_size=2,
                       learning_rate=5e-2, max_steps=8, save_strategy="no")
    # half the records without an image, to train on or to evaluate: FSDP2 would hang its ranks in the
    # vision tower, so the run stops first
    texts = tmp_path / "data" / "mixed.jsonl"
    texts.write_text("".join(line if i % 2 else json.dumps({"query": "Name a colour.", "response": "red"}) + "\n"
                             for i, line in enumerate(open(data))))
    *trained_runs, mixed, mixed_val = run_workers([dict(run_dir=lora), dict(run_dir=ddp),
                             planned(fsdp, **full, per_device_train_batch_size=2, fsdp="full_shard", nproc_per_node=2),
                             planned(zero2, **zero2_job, nproc_per_node=2),
                             planned(zero3, **full, per_device_train_batch_size=2, deepspeed="zero3", nproc_per_node=2),
                             planned(padfree, **full, per_device_train_batch_size=2, fsdp="full_shard",
                                     nproc_per_node=2, padding_free=True, gradient_checkpointing=False),
                             dict(run_dir=packed),
                             planned(tmp_path / "mixed", **{**full, "dataset": [str(texts)]},
                                     per_device_train_batch_size=2, fsdp="full_shard", nproc_per_node=2),
                             planned(tmp_path / "mixed-val", **full, val_dataset=[str(texts)], eval_steps=3,
                                     per_device_train_batch_size=2, deepspeed="zero3", nproc_per_node=2)], 400)
    for proc in trained_runs:
        assert proc.returncode == 0, proc.log[-4000:]
    for proc, field, engine in ((mixed, "dataset", "FSDP2"), (mixed_val, "val_dataset", "ZeRO-3")):
        assert proc.returncode != 0 and f"{field}: 16 records have no image beside 16 that do: on this engine (" \
            in proc.log and engine in proc.log, proc.log[-3000:]
    for run in (lora, packed):
        curve = losses(run)
        assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1] - 0.3, (run.name, curve)
    ready = [e for e in events(lora, 0, "data") if e.get("phase") == "ready"][0]
    assert (ready["skipped"], [m.split(": ")[0] for m in ready["skipped_first"]]) == (2, [f"{skipping}:33", f"{skipping}:34"])
    for run in (fsdp, zero2, zero3, padfree):
        for step, value in losses(run).items():
            assert value == pytest.approx(losses(ddp)[step], rel=1e-4), (run.name, step)
    trained = {e["step"] for e in events(fsdp, 0, "train")}
    assert trained == {1, 2, 3}
    # resumed: LoRA on DDP from its step-4 checkpoint (the skipped records skipped again), full
    # fine-tuning on ZeRO-2 from step 2, each on the losses of the run it resumes
    assert_resumes_the_same(lora, write_run(tmp_path / "lora-resumed", **lora_job), 2, 4, 8)
    assert_resumes_the_same(zero2, write_run(tmp_path / "zero2-resumed", **zero2_job), 2, 2, 3)
    # ZeRO-2's full checkpoint (saved under transformers' checkpoint names) exports: the language model
    # trained, the vision tower as it was (freeze_vit), the aligner too (aligner_lr)
    full_export = export(zero2, None, tmp_path / "zero2-export")["out"]
    before = AutoModelForImageTextToText.from_pretrained(tiny_qwen25_vl, dtype=torch.float32).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(full_export, dtype=torch.float32).state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if ".visual." in k and ".merger." not in k)
    merger = [k for k in before if ".visual.merger." in k]
    assert merger and all(torch.allclose(before[k], after[k], rtol=0, atol=1e-12) for k in merger)
    assert not torch.equal(before["model.language_model.layers.0.mlp.up_proj.weight"],
                           after["model.language_model.layers.0.mlp.up_proj.weight"])

    assert_the_export_answers_better(lora, tiny_qwen25_vl, data, tmp_path)
    shutil.rmtree(tmp_path / "cache")


@pytest.mark.e2e
def test_dpo_on_image_pairs_learns_which_colour_the_image_shows(tmp_path, tiny_qwen25_vl):
    """DPO on pairs whose prompt holds an image (the colour named chosen, another rejected): LoRA on two
    DDP ranks (the reference the model with its adapters off) raises the reward accuracy above 0.9;
    full fine-tuning on FSDP2 from precomputed reference log-probs (a pass over the pairs' pixels
    first) widens the margins."""
    data = colour_pairs(tmp_path / "data", 32)
    common = dict(model=str(tiny_qwen25_vl), dataset=[data], rlhf_type="dpo", beta=0.5, max_length=96, logging_steps=1,
                  torch_dtype="float32", lora_dropout=0.0, warmup_ratio=0.0, save_strategy="no",
                  per_device_train_batch_size=4, dataset_cache_dir=str(tmp_path / "cache"))
    lora = write_run(tmp_path / "lora", **common, train_type="lora", learning_rate=1e-2, max_steps=24)
    full = tmp_path / "full"
    for proc in run_workers([dict(run_dir=lora),
                             planned(full, **common, train_type="full", learning_rate=3e-3, max_steps=4,
                                     fsdp="full_shard", precompute_ref_log_probs=True, nproc_per_node=2)], 400):
        assert proc.returncode == 0, proc.log[-4000:]
    trained = {e["step"]: e for e in events(lora, 0, "train")}
    assert sorted(trained) == list(range(1, 25))
    assert trained[1]["rewards_margins"] == pytest.approx(0, abs=0.05)
    assert sum(trained[s]["rewards_accuracies"] for s in (21, 22, 23, 24)) / 4 > 0.9, trained
    assert "reference log-probs of 32 pairs computed" in (full / "logs" / "local.log").read_text()
    margins = [e["rewards_margins"] for e in sorted(events(full, 0, "train"), key=lambda e: e["step"])]
    assert len(margins) == 4 and margins[-1] > margins[0], margins


@pytest.mark.e2e
def test_streamed_image_records_train_skip_and_resume_with_their_images(tmp_path, tiny_qwen25_vl):
    """streaming with images: LoRA on two DDP ranks reads the records as it trains, each image counted
    as its record is read; a record whose image is missing is skipped and counted (strict off); the
    stream's position, with its buffered samples' images, resumes at step 3 with the same losses."""
    data = Path(colour_images(tmp_path / "data", 24))
    lines = data.read_text().splitlines()
    lines.insert(2, json.dumps({**json.loads(lines[0]), "images": ["gone.png"]}))  # line 3, read in the first step
    data.write_text("\n".join(lines) + "\n")
    job = dict(model=str(tiny_qwen25_vl), dataset=[str(data)], streaming=True, strict=False, max_steps=5, save_steps=3,
               max_length=96, logging_steps=1, torch_dtype="float32", lora_dropout=0.0, warmup_ratio=0.0,
               train_type="lora", learning_rate=5e-2, per_device_train_batch_size=2)
    run = write_run(tmp_path / "streamed", **job)
    proc, = run_workers([dict(run_dir=run)], 300)
    assert proc.returncode == 0, proc.log[-4000:]
    curve = losses(run)
    assert sorted(curve) == [1, 2, 3, 4, 5] and curve[5] < curve[1], curve
    skipped = [e for e in events(run, 0, "data") if e.get("skipped")] + [e for e in events(run, 1, "data")
                                                                         if e.get("skipped")]
    assert skipped and "gone.png not found" in skipped[-1]["skipped_first"][0], skipped
    assert_resumes_the_same(run, write_run(tmp_path / "resumed", **job), 2, 3, 5)


def assert_the_export_answers_better(lora: Path, base_dir: Path, data: str, tmp_path: Path) -> None:
    """The LoRA run's export loads with its image processor (saved beside the weights) and its loss on
    the data's first image record is below the base model's."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from launcher.export import export
    from launcher.vision import Images

    out = export(lora, None, tmp_path / "exported")["out"]
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    exported = Images(out, model.config)
    sample = encode(Record(f"{data}:1", json.loads(open(data).readline()), str(Path(data).parent)),
                    AutoTokenizer.from_pretrained(out), 96, Persona(images=True), exported)
    batch = Batches(lambda members: [sample], one_per_row(1), 1, 1, 1, 0, 0, False, 96)
    batch.media = exported
    inputs, _, _ = batch.batch_of([0])
    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        assert float(model(**inputs).loss) < float(base(**inputs).loss) - 0.2


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["glm4v", "internvl"])
def test_glm4v_and_internvl_train_on_images_on_ddp_fsdp2_and_tp_and_their_lora_exports(tmp_path, tmp_path_factory, family):
    """GLM-4V (its tower, merger and language model as transformers builds them on Qwen2-VL's rope)
    and InternVL (tiles, its image runs between <img> and </img>, placed as text): LoRA on two DDP
    ranks lowers the loss and exports with its image processor, and the export's loss on an image
    record is below the base model's; full fine-tuning of the language model on FSDP2 (the tower in
    units of its own) trains DDP's losses; under TP=2 (full for GLM-4V, LoRA for InternVL) one rank's."""
    model_dir = build_tiny_vl_model(tmp_path_factory.mktemp(f"{family}-e2e"), family)
    data = colour_images(tmp_path / "data", 32)
    common = dict(model=str(model_dir), dataset=[data], max_length=96, logging_steps=1, torch_dtype="float32",
                  lora_dropout=0.0, warmup_ratio=0.0, dataset_cache_dir=str(tmp_path / "cache"))
    lora = write_run(tmp_path / "lora", **common, train_type="lora", per_device_train_batch_size=4,
                     learning_rate=5e-2, max_steps=8, save_steps=8)
    full = dict(**common, train_type="full", learning_rate=3e-3, max_steps=3, save_strategy="no",
                per_device_train_batch_size=2)
    ddp, fsdp = write_run(tmp_path / "ddp", **full), tmp_path / "fsdp2"
    # TP=2 (the language model split by its TP plan, the tower whole on both ranks) against one rank:
    # GLM-4V's fused gate_up under full fine-tuning, InternVL's Qwen2 plan under LoRA
    split = {**full, "train_type": "full" if family == "glm4v" else "lora"}
    one, tp = tmp_path / "one", tmp_path / "tp2"
    for proc in run_workers([dict(run_dir=lora), dict(run_dir=ddp),
                             planned(fsdp, **full, fsdp="full_shard", nproc_per_node=2),
                             planned(one, **split, nproc_per_node=1),
                             planned(tp, **split, nproc_per_node=2, tensor_model_parallel_size=2)], 400):
        assert proc.returncode == 0, proc.log[-4000:]
    curve = losses(lora)
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1] - 0.3, curve
    for run, baseline in ((fsdp, ddp), (tp, one)):
        assert sorted(losses(run)) == [1, 2, 3]
        for step, value in losses(run).items():
            assert value == pytest.approx(losses(baseline)[step], rel=1e-4), (run.name, step)
    assert losses(one)[3] < losses(one)[1]
    assert_the_export_answers_better(lora, model_dir, data, tmp_path)


def test_the_estimate_counts_the_vision_tower_and_aligner_as_transformers_builds_them(tiny_vl):
    """modelcfg's count of a Qwen-VL family's vision tower, aligner and language model is the built
    model's (Qwen2-VL's too, from a config); full fine-tuning trains what the freezes leave, LoRA the
    tower's adapters peft builds."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from backend.job.memory import estimate_memory, trainable_params
    from backend.job.modelcfg import parse_model_config
    from launcher.model import add_lora
    from launcher.vision import vision_parts

    qwen2 = AutoConfig.for_model(
        "qwen2_vl", text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=400,
                                     rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=4, patch_size=14))
    for config in (AutoConfig.from_pretrained(tiny_vl), qwen2):
        parts = vision_parts(AutoModelForImageTextToText.from_config(config))
        built = [sum(p.numel() for p in {id(p): p for m in part for p in m.parameters()}.values()) for part in parts]
        parsed = parse_model_config(config.to_dict())
        assert built == [parsed.vision_params, parsed.aligner_params, parsed.param_count()], config.model_type
        job = dict(model="m", dataset=["d"], train_type="full")
        assert trainable_params(JobSpec(**job), parsed) == built[2]
        assert trainable_params(JobSpec(**job, freeze_vit=False, freeze_aligner=False), parsed) == sum(built)
        assert trainable_params(JobSpec(**job, freeze_vit=False, freeze_llm=True), parsed) == built[0]
        # LoRA with the tower unfrozen: the adapters peft puts on its blocks' linear layers
        lora = dict(model="m", dataset=["d"], train_type="lora", lora_rank=8)
        base = AutoModelForImageTextToText.from_config(config)
        vit = vision_parts(base)[0]
        add_lora(base, JobSpec(**lora, freeze_vit=False))
        tower_adapters = sum(p.numel() for m in vit for n, p in m.named_parameters() if "lora_" in n)
        assert trainable_params(JobSpec(**lora, freeze_vit=False), parsed) - \
            trainable_params(JobSpec(**lora), parsed) == tower_adapters > 0, config.model_type
        # TP plans split the language model: the tower and aligner are whole on every TP rank
        states = lambda **f: estimate_memory(JobSpec(**job, freeze_vit=False, freeze_aligner=False,  # noqa: E731
                                                     nproc_per_node=2, **f), parsed, device="cpu")
        one, tp = states(), states(tensor_model_parallel_size=2)
        for part in ("gradients_gib", "optimizer_gib"):
            assert getattr(tp, part) == pytest.approx(getattr(one, part) * (built[2] / 2 + built[0] + built[1]) / sum(built))


def test_the_data_preview_shows_an_image_records_thumbnail_and_its_visual_tokens(tmp_path, tiny_vl, images):
    """The Train tab's preview of a vision-language job: each shown record's images as thumbnails the
    preview made (PNG data: URIs, nothing of the user's referenced), its placeholder run shown once
    with its count; the lengths are the worker's, image tokens included."""
    import base64
    import io

    from PIL import Image
    from transformers import AutoConfig, AutoTokenizer

    from launcher.preview import preview
    from studio.preview_view import preview_html

    data = colour_images(tmp_path / "data", 4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    spec = JobSpec(model=str(tiny_vl), dataset=[data], max_length=96)
    dataset, = preview(spec, tokenizer, images)["datasets"]
    assert dataset["error"] is None and dataset["count"] == 4 and len(dataset["samples"]) == 3
    first = dataset["samples"][0]
    uri, = first["images"]
    thumb = Image.open(io.BytesIO(base64.b64decode(uri.removeprefix("data:image/png;base64,"))))
    assert thumb.format == "PNG" and max(thumb.size) <= 96
    prompt = "".join(text for text, trained in first["segments"] if not trained)
    config = AutoConfig.from_pretrained(tiny_vl)  # GLM-4V names its image's bounds image_start/end
    start, end = tokenizer.convert_ids_to_tokens(list(images.bounds) if images.tiled else [
        getattr(config, "vision_start_token_id", None) or config.image_start_token_id,
        getattr(config, "vision_end_token_id", None) or config.image_end_token_id])
    placeholder = tokenizer.convert_ids_to_tokens(images.token_id)
    tokens = images.tokens("", str(tmp_path / "data" / "0.png"))
    assert f"{start}{placeholder}×{tokens}{end}What colour is it?" in prompt
    assert dataset["lengths"][0] == first["tokens"] > tokens
    page = preview_html({"max_length": 96, "packing": False, "row_fill": 0.5, "packed_fill": 0.9,
                         "datasets": [{**dataset, "samples": [{**first, "images": [uri, "https://example.com/x.png"]}]}]})
    assert page.count("<img ") == 1 and "example.com" not in page


def test_an_internvl_whose_tokenizer_has_no_image_bounds_is_refused_by_name(tmp_path):
    """A tokenizer from another tool without InternVL's <img> and </img>: the visual tokens would have
    no bounds the model was trained with; refused naming the model directory."""
    from transformers import AutoConfig, AutoTokenizer

    from backend.job.errors import UserError
    from launcher.vision import Images

    model = build_tiny_vl_model(tmp_path / "internvl", "internvl")
    AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model").save_pretrained(model)  # no image tokens
    with pytest.raises(UserError, match=f"model: {model}'s tokenizer has no <img> and </img> tokens"):
        Images(str(model), AutoConfig.from_pretrained(model))


def test_an_export_keeps_the_image_size_the_run_trained_with(tmp_path, tiny_vl):
    """The image processor saved beside an export limits images to the run's max_pixels, so the
    exported model is shown images as it was trained on them (GLM-4V's processor too, whose bound
    counts an image's two temporal frames)."""
    from transformers import AutoImageProcessor

    from launcher.vision import save_image_processor

    from backend.job.errors import UserError

    unbounded = JobSpec(model=str(tiny_vl), dataset=["d.jsonl"])
    capped_job = unbounded.model_copy(update={"max_pixels": 56 * 56})
    save_image_processor(str(tiny_vl), tmp_path / "as-is", unbounded)
    if "internvl" in str(tiny_vl):  # its tiles have a fixed size: a pixel bound is refused by name
        with pytest.raises(UserError, match="max_pixels: GotOcr2ImageProcessorPil cuts images into tiles"):
            save_image_processor(str(tiny_vl), tmp_path / "capped", capped_job)
        return
    save_image_processor(str(tiny_vl), tmp_path / "capped", capped_job)
    as_is, capped = (AutoImageProcessor.from_pretrained(tmp_path / name) for name in ("as-is", "capped"))
    assert as_is.size == AutoImageProcessor.from_pretrained(tiny_vl).size
    patches = [p.get_number_of_image_patches(448, 448, {}) for p in (as_is, capped)]
    assert patches[1] <= (56 // capped.patch_size) ** 2 < patches[0]  # a large image shown at most 56x56


def tower(model):
    """The module a model runs its images through: Qwen's and GLM-4V's `visual`, InternVL's `vision_tower`."""
    inner = (model.get_base_model() if hasattr(model, "get_base_model") else model).model
    return inner.visual if hasattr(inner, "visual") else inner.vision_tower


def test_the_chat_worker_answers_about_an_uploaded_image_through_the_vision_tower(tmp_path, tiny_vl):
    """A chat request's image (a data: URI: a request names no file) goes through the vision tower
    of both models, as its run of visual tokens in the prompt; the LoRA path's one batch and the
    separate base's alike. A text model, a tag without its image and a bad image are refused by name."""
    import base64

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from backend.job.chat import ChatError, parse_request, request_line
    from launcher.chat import Loaded, answer
    from launcher.model import load_tokenizer
    from launcher.vision import Images

    colour_images(tmp_path, 1)
    uri = "data:image/png;base64," + base64.b64encode((tmp_path / "0.png").read_bytes()).decode()
    config = AutoConfig.from_pretrained(tiny_vl)
    images = Images(str(tiny_vl), config)
    tokenizer = load_tokenizer(str(tiny_vl))
    tuned, base = (AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval() for _ in range(2))
    seen = []
    for model in (tuned, base):
        tower(model).register_forward_hook(lambda module, args, out: seen.append(module))
    loaded = Loaded(tuned, base, tokenizer, torch.device("cpu"), {"max_positions": 4096, "system": None}, images)
    ask = [{"role": "user", "content": "<image>What colour is it?", "images": [uri]}]

    def reply(messages, to=loaded) -> dict:
        events = []
        answer(to, parse_request(request_line("1", [("base", messages), ("tuned", messages)], 3, 0.0)), events.append)
        return {e["model"]: e for e in events if e["type"] == "done"}

    def inputs_shape(module, args, kwargs, out):  # InternVL's tower takes pixel_values by name
        seen.append((args or tuple(kwargs.values()))[0].shape)

    done = reply(ask)
    visual = images.tokens("test", uri)
    plain = reply([{"role": "user", "content": "What colour is it?"}])
    # once each (the prompt; not again per new token), on threads of their own
    assert visual > 1 and sorted(map(id, seen)) == sorted(map(id, (tower(tuned), tower(base))))
    # the image's placeholder (one token when the template renders it) becomes its visual tokens
    assert {e["prompt_tokens"] for e in done.values()} == {plain["base"]["prompt_tokens"] + 2 + visual}, (done, plain)

    # LoRA: one batch, the base's row with the adapter off; the tower runs once over both rows' images
    from launcher.model import add_lora

    lora = add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32),
                    JobSpec(model="m", dataset=["d"])).eval()
    tower(lora).register_forward_hook(inputs_shape, with_kwargs=True)
    seen.clear()
    batched = reply(ask, Loaded(lora, None, tokenizer, torch.device("cpu"), {"max_positions": 4096, "system": None},
                                images))
    assert {e["prompt_tokens"] for e in batched.values()} == {done["base"]["prompt_tokens"]}
    # both rows' patches (InternVL's tower: both rows' tiles)
    rows = 2 * (visual // images.per_tile if images.tiled else visual * images.merge ** 2)
    assert len(seen) == 1 and seen[0][0] == rows, seen

    # LoRA in the tower too: peft's per-row adapters cannot split the tower's patch rows, so the
    # base (adapter off) and the fine-tuned model answer one after the other, each seeing the image
    adapted = add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32),
                       JobSpec(model="m", dataset=["d"], freeze_vit=False)).eval()
    tower(adapted).register_forward_hook(inputs_shape, with_kwargs=True)
    seen.clear()
    alone = reply(ask, Loaded(adapted, None, tokenizer, torch.device("cpu"), {"max_positions": 4096, "system": None},
                              images))
    assert {e["prompt_tokens"] for e in alone.values()} == {done["base"]["prompt_tokens"]} and len(seen) == 2
    # "<image>" written in a message without images (an answer about the tag) stays text
    talk = [{"role": "user", "content": "Name the tag."}, {"role": "assistant", "content": "It is <image>."}, *ask]
    [longer] = {e["prompt_tokens"] for e in reply(talk).values()}
    assert longer > done["base"]["prompt_tokens"]

    def refused(messages, to=loaded) -> str:
        with pytest.raises(ChatError) as err:
            reply(messages, to)
        return str(err.value)

    import launcher.chat

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher.chat, "MAX_CHAT_PIXELS", 1000)
        assert "pixels, more than the 0 million a chat image may have" in refused(ask)
    many = [{"role": "user", "content": "<image>" * 3, "images": [uri] * 3}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "<image><image>", "images": [uri] * 2}]
    with pytest.raises(ChatError, match=r"messages: 5 images, more than the 4 a conversation may hold"):
        parse_request(request_line("1", [("base", many)], 3, 0.0))
    # named LoRA targets that reach no layer of a part that trains: refused, naming that part's own
    from launcher.model import ModelError

    with pytest.raises(ModelError, match=r"^target_modules: q_proj name no linear layer of the aligner, which trains"):
        add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32),
                 JobSpec(model="m", dataset=["d"], freeze_aligner=False, target_modules=["q_proj"]))

    assert refused(ask, Loaded(tuned, base, tokenizer, torch.device("cpu"), {"max_positions": 4096, "system": None})) \
        == ("images: the loaded model takes no images (not a vision-language model, or its image processor could "
            "not be read)")
    broken = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    assert "is not an image PIL can read" in refused([{**ask[0], "images": [broken]}])
    with pytest.raises(ChatError, match=r"messages\[0\]\.content: 0 <image> tag\(s\) for 1 image\(s\)"):
        parse_request(request_line("1", [("base", [{**ask[0], "content": "What colour?"}])], 3, 0.0))
    with pytest.raises(ChatError, match=r"images\[0\]: expected a data:image/...;base64, URI \(a request names no file\)"):
        parse_request(request_line("1", [("base", [{**ask[0], "images": [str(tmp_path / "0.png")]}])], 3, 0.0))
