"""Training data: records (read by `backend.job.records`) turned into token ids and labels, packed
or padded into micro-batches.

The records are tokenized once into an Arrow cache (`launcher.tokenized`) before training starts,
so a bad record stops the job at once with its file and line, not at step 900; each rank reads its
shard (record i of a dataset belongs to data-parallel rank i % world_size) from it.
"""
from __future__ import annotations

import bisect
import heapq
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from backend.job.records import (DataError, Persona, Record, check_record, is_pretokenized, parse_source, pretokenized,
                                 read_records, record_media, to_messages, to_pair)

IGNORE = -100
# ChatML, used when a tokenizer ships without a chat template (base models).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---- tokenization --------------------------------------------------------------------------


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    images: list[str] = field(default_factory=list)
    """A vision-language sample's image and video files, in the order of their placeholder runs in input_ids."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Pair:
    """A preference pair: the prompt with its chosen answer and with its rejected one, labels on the answers."""
    chosen: Sample
    rejected: Sample

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def encode(record: Record, tokenizer, max_length: int, persona: Persona = Persona(),
           images=None) -> Sample | Pair | None:
    """Token ids and labels (IGNORE outside the assistant responses of chat data), truncated.
    None when truncation left no token to learn from (or cut into an image's tokens). A preference
    job's records are `Pair`s. `images` (`launcher.vision.Images`): a vision-language model's, for
    the records' `images` and `videos`."""
    record = persona.renamed(record)
    if persona.pairs:
        return _pair(record, tokenizer, max_length, persona, images)
    if is_pretokenized(record):
        return _pretokenized(record, max_length)
    messages, text = to_messages(record, persona)
    paths = record_media(record, messages) if persona.images and messages else []
    if paths:
        from launcher.vision import with_image_parts

        messages = with_image_parts(messages, videos=bool(record.data.get("videos")))
    if messages is None:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        ids = ids[:max_length]
        return Sample(ids, list(ids)) if len(ids) > 1 else None
    ids: list[int] = []
    labels: list[int] = []
    # Render prefix by prefix: the tokens an assistant turn adds to the rendered conversation
    # are its response (works for any template, no `{% generation %}` markers needed).
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        full = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(prompt)] != prompt or full[: len(ids)] != ids:
            raise DataError(f"{record.where}: the chat template does not render conversations prefix-stably; "
                            "cannot locate the response tokens")
        labels += [IGNORE] * (len(prompt) - len(ids)) + full[len(prompt):]
        ids = full
    if paths:
        ids, labels = expand_media(record.where, ids, labels, paths, images)
        if len(ids) > max_length and not images.ids.isdisjoint(ids[max_length:]):
            return None  # an image or video cut off: its pixels would not match its tokens
    ids, labels = ids[:max_length], labels[:max_length]
    return Sample(ids, labels, paths) if any(label != IGNORE for label in labels[1:]) else None


def encode_checked(record: Record, tokenizer, max_length: int, persona: Persona, images=None,
                   strict: bool = True) -> Sample | Pair | None:
    """`encode`; `strict` off, a vision-language record's media are decoded here too (its images
    whole, its videos' frames that training reads), so a damaged one fails here, where the record
    can be skipped, not in a training step."""
    if not strict and persona.images:
        check_record(record, persona)
    sample = encode(record, tokenizer, max_length, persona, images)
    shown = sample.chosen if isinstance(sample, Pair) else sample  # a pair's rows show the same media
    if not strict and shown is not None and persona.videos:
        images.decode_videos(record.where, shown.input_ids, shown.images)
    return sample


def expand_media(where: str, ids: list[int], labels: list[int], paths: list[str], images
                 ) -> tuple[list[int], list[int]]:
    """Each image's and video's placeholder token repeated once per visual token of it (unlabelled;
    InternVL's image run between its start and end tokens); the chat worker's prompts too. `paths`
    in the order of their tags."""
    placeholders = {images.token_id, images.video_token_id} - {None}
    at = [i for i, token in enumerate(ids) if token in placeholders]
    if len(at) != len(paths):
        raise DataError(f"{where}: the chat template renders {len(at)} image or video placeholder(s) for "
                        f"{len(paths)} image(s) and video(s); check its <image> and <video> tags and that the model's "
                        "template takes image and video parts")
    out_ids, out_labels, start = [], [], 0
    for i, path in zip(at, paths):
        run = images.run(where, ids[i], path)
        out_ids += ids[start:i] + run
        out_labels += labels[start:i] + [IGNORE] * len(run)
        start = i + 1
    return out_ids + ids[start:], out_labels + labels[start:]


def _pair(record: Record, tokenizer, max_length: int, persona: Persona, images=None) -> Pair | None:
    """The prompt rendered once, each answer after it (labels on the answer and its end-of-turn
    tokens only), each truncated to max_length; None when either answer is cut away entirely (or an
    image or video of the prompt is). `images`: `encode`'s; the prompt's images and videos are in both
    rows."""
    prompt, chosen, rejected = to_pair(record, persona)
    paths = record_media(record, prompt) if persona.images else []
    if paths:
        from launcher.vision import with_image_parts

        prompt = with_image_parts(prompt, videos=bool(record.data.get("videos")))
    asked = render(tokenizer, prompt, add_generation_prompt=True)
    samples = []
    for answer in (chosen, rejected):
        full = render(tokenizer, prompt + [{"role": "assistant", "content": answer}], add_generation_prompt=False)
        if full[:len(asked)] != asked:
            raise DataError(f"{record.where}: the chat template does not render conversations prefix-stably; "
                            "cannot locate the answer tokens")
        ids, labels = full, [IGNORE] * len(asked) + full[len(asked):]
        if paths:
            ids, labels = expand_media(record.where, ids, labels, paths, images)
            if len(ids) > max_length and not images.ids.isdisjoint(ids[max_length:]):
                return None
        ids, labels = ids[:max_length], labels[:max_length]
        if not any(label != IGNORE for label in labels[1:]):
            return None
        samples.append(Sample(ids, labels, paths))
    return Pair(*samples)


def _pretokenized(record: Record, max_length: int) -> Sample | None:
    ids, labels = pretokenized(record)
    ids, labels = ids[:max_length], labels[:max_length]
    return Sample(ids, labels) if any(label != IGNORE for label in labels[1:]) else None


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a conversation through the chat template, as training sees it (the chat worker
    renders its prompts with this too, so a fine-tuned model is asked in its training format)."""
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- packing and batching ------------------------------------------------------------------


@dataclass
class Row:
    """One training sequence: a padded sample, or several samples packed with restarting positions."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    n_samples: int
    images: list[str] = field(default_factory=list)


@dataclass
class RowPlan:
    """Which samples (indices into a rank's samples) make each row: row i is
    members[starts[i]:starts[i + 1]], in data order. Arrays, so a rank of a million samples holds
    a few MB, not a million lists."""

    members: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row(self, i: int) -> np.ndarray:
        return self.members[self.starts[i]:self.starts[i + 1]]


def one_per_row(n: int) -> RowPlan:
    return RowPlan(np.arange(n), np.arange(n + 1))


def pack_plan(lengths: np.ndarray, max_length: int) -> RowPlan:
    """Best-fit decreasing bin packing into rows of at most `max_length` tokens: longest sample
    first, each into the fullest row that still has room (rows come out 99% full on lengths
    spread evenly over 50-2,048 tokens, where filling rows in data order left ~25% padding); among
    rows as full, the oldest. Rows are kept by their free room (at most max_length distinct values),
    so each sample costs a bisection and a heap operation however many rows there are."""
    lengths = np.asarray(lengths, dtype=np.int64)
    row_of = np.empty(len(lengths), dtype=np.int64)
    frees: list[int] = []  # sorted free-room values that some row has
    rows_with: dict[int, list[int]] = {}  # free room -> heap of rows
    n_rows = 0
    for index in np.argsort(-lengths, kind="stable").tolist():
        size = int(lengths[index])
        at = bisect.bisect_left(frees, size)
        if at == len(frees):
            row, free = n_rows, max_length - size
            n_rows += 1
        else:
            old = frees[at]
            row = heapq.heappop(rows_with[old])
            if not rows_with[old]:
                del rows_with[old], frees[at]
            free = old - size
        row_of[index] = row
        if free > 0:
            if free not in rows_with:
                rows_with[free] = []
                bisect.insort(frees, free)
            heapq.heappush(rows_with[free], row)
    members = np.argsort(row_of, kind="stable")
    return RowPlan(members, np.concatenate(([0], np.cumsum(np.bincount(row_of, minlength=n_rows)))))


def packed_row(samples: list[Sample]) -> Row:
    """Samples in one row with position ids restarting at 0 for every sample, which is how
    transformers' mask builders (and flash-attention's varlen path) tell samples apart when no
    attention mask is passed, so no token attends across samples. The first label of every sample
    is ignored: it would be predicted from the previous sample."""
    row = Row([], [], [], 0)
    for sample in samples:
        row.input_ids += sample.input_ids
        row.labels += [IGNORE] + sample.labels[1:]
        row.position_ids += list(range(len(sample)))
        row.n_samples += 1
        row.images += sample.images
    return row


def padded_row(sample: Sample, counted: bool = True) -> Row:
    """`counted`: the row is a sample of its own (a pair's rejected row is not)."""
    return Row(sample.input_ids, sample.labels, list(range(len(sample))), int(counted), sample.images)


def pack(samples: list[Sample], max_length: int) -> list[Row]:
    """The rows `pack_plan` makes of `samples`."""
    plan = pack_plan(np.array([len(s) for s in samples]), max_length)
    return [packed_row([samples[i] for i in plan.row(r)]) for r in range(len(plan))]


def unpacked(samples: list[Sample]) -> list[Row]:
    return [padded_row(s) for s in samples]


def collate(rows: list[Row], pad_id: int, packed: bool, pad_to: int | None = None, multiple: int = 1,
            media=None) -> dict:
    """Tensors for one micro-batch. Packed rows get no attention mask (the position ids carry the
    sample boundaries; padding forms its own block); padded rows get one. The width is a multiple
    of `multiple` (`backend.job.capabilities.seq_multiple`: SP and CP groups split every row evenly).
    `media` (`launcher.vision.Images`): the rows' images and videos as the model's pixel inputs, and no
    position ids where the model places its image tokens itself (its multimodal rope), but for packed
    rows, whose samples' positions it cannot tell apart (`Images.packed_positions`)."""
    import torch

    width = pad_to or max(len(r.input_ids) for r in rows)
    width = -(-width // multiple) * multiple
    ids, labels, pos, mask = [], [], [], []
    for r in rows:
        pad = width - len(r.input_ids)
        ids.append(r.input_ids + [pad_id] * pad)
        labels.append(r.labels + [IGNORE] * pad)
        pos.append(r.position_ids + list(range(pad)))
        mask.append([1] * len(r.input_ids) + [0] * pad)
    batch = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(pos)}
    if not packed:
        batch["attention_mask"] = torch.tensor(mask)
    if media is not None:
        found = [found for r in rows for found in media.media("training data", r.input_ids, r.images)]
        pixels = media.pixels(found) if found else {}
        batch.update(pixels)
        # Qwen's and GLM-4V's models place their image tokens themselves (multimodal rope), from the
        # token types the processor would give (transformers 5.24 computes none without them); packed
        # rows are placed here, sample by sample, as the model would place each alone
        extra = media.inputs(batch["input_ids"])
        if extra and packed:
            batch["position_ids"] = media.packed_positions(batch["input_ids"], batch["position_ids"], pixels)
        elif extra:
            del batch["position_ids"]
        batch.update(extra)
    return batch


def flattened(rows: list[Row]) -> Row:
    """The rows end to end as one (padding_free), in their order: positions restart with every row,
    and every row's first label is ignored (it would be predicted from the row before)."""
    row = Row([], [], [], 0)
    for r in rows:
        row.input_ids += r.input_ids
        row.labels += [IGNORE] + r.labels[1:]
        row.position_ids += r.position_ids
        row.n_samples += r.n_samples
        row.images += r.images
    return row


def micro_batch(rows: list[Row], pad_id: int, packed: bool, max_length: int, multiple: int = 1,
                flat: bool = False, media=None) -> tuple[dict, int, int]:
    """(batch, tokens, samples) of the rows: packed rows padded to max_length, padded ones to the
    longest; `flat` (padding_free): all of them one row without padding (but to `multiple`);
    `media`: `collate`'s."""
    tokens, samples = sum(len(r.input_ids) for r in rows), sum(r.n_samples for r in rows)
    if flat:
        return collate([flattened(rows)], pad_id, True, None, multiple, media), tokens, samples
    return collate(rows, pad_id, packed, max_length if packed else None, multiple, media), tokens, samples


class Batches:
    """Micro-batches of one rank, reshuffled every epoch with a seed, addressable by global
    optimizer step so a resume continues at the exact data position. Rows are made from the
    samples when a step asks for them (`fetch`: sample indices → Samples, e.g. from the Arrow cache)."""

    def __init__(self, fetch: Callable[[np.ndarray], list[Sample]], plan: RowPlan, micro_batch: int,
                 accumulation: int, steps_per_epoch: int, seed: int, pad_id: int, packed: bool, max_length: int,
                 multiple: int = 1, pairs: bool = False, flat: bool = False):
        self.fetch, self.plan, self.micro_batch, self.accumulation = fetch, plan, micro_batch, accumulation
        self.multiple, self.pairs = multiple, pairs  # pairs: preference pairs, two rows each
        self.flat = flat  # padding_free: a micro-batch's rows end to end in one
        self.steps_per_epoch, self.seed, self.pad_id, self.packed = steps_per_epoch, seed, pad_id, packed
        self.max_length = max_length
        self._epoch: int | None = None
        self._epoch_order: list[int] = []
        self.media = None
        """A vision-language model's `launcher.vision.Images`: the micro-batches' pixel inputs."""
        self.reference: Callable[[np.ndarray], np.ndarray] | None = None
        """Preference pairs with precomputed reference log-probs: the plan's sample indices → their
        (chosen, rejected) log-probs, handed along as the micro-batch's `reference_logps`."""

    def _order(self, epoch: int) -> list[int]:
        # Shuffling is O(rows); steps ask for the same epoch thousands of times in a row.
        if epoch != self._epoch:
            order = list(range(len(self.plan)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._epoch, self._epoch_order = epoch, order
        return self._epoch_order

    def rows(self, indices: list[int], fill: int = 0) -> list[Row]:
        """The rows `indices`, then `fill` rows of one pad token without labels. Preference pairs:
        their chosen rows, then their rejected rows (each half filled alike)."""
        members = [self.plan.row(i) for i in indices]
        samples = self.fetch(np.concatenate(members)) if members else []
        filler = [Row([self.pad_id], [IGNORE], [0], 0) for _ in range(fill)]
        # A micro-batch of filler alone (a rank with fewer micro-batches than the forwards all ranks
        # run) is pair-shaped too: an engine set up for one micro-batch shape refuses another.
        if self.pairs:
            return ([padded_row(p.chosen) for p in samples] + filler
                    + [padded_row(p.rejected, counted=False) for p in samples] + filler)
        if not self.packed:
            return [padded_row(s) for s in samples] + filler
        samples = iter(samples)
        return [packed_row([next(samples) for _ in m]) for m in members] + filler

    def batch_of(self, indices: list[int], fill: bool = False) -> tuple[dict, int, int]:
        """The rows `indices` as one micro-batch: (batch, tokens, samples). `fill`: rows of one pad
        token without labels make up a short micro-batch's size (engines set up for one micro-batch
        size, as DeepSpeed's Ulysses is, refuse another; such rows add no loss and no count)."""
        filled = self.micro_batch - len(indices) if fill else 0
        batch, tokens, samples = micro_batch(self.rows(indices, filled), self.pad_id, self.packed, self.max_length,
                                             self.multiple, self.flat, self.media)
        if self.reference is not None:  # chosen rows, then rejected rows, each half filled alike
            import torch

            members = np.concatenate([self.plan.row(i) for i in indices]) if indices else np.zeros(0, np.int64)
            logps = np.asarray(self.reference(members), dtype=np.float32).reshape(-1, 2)
            # A flattened row's filler has no labels, so no answer of its own to hold a place for.
            pad = np.zeros(0 if self.flat else filled, np.float32)
            batch["reference_logps"] = torch.from_numpy(np.concatenate([logps[:, 0], pad, logps[:, 1], pad]))
        return batch, tokens, samples

    def step(self, step: int) -> list[tuple[dict, int, int]]:
        """Micro-batches of optimizer step `step` (0-based): (batch, tokens, samples) each."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        return [self.batch_of(order[start:start + self.micro_batch])
                for start in ((within * self.accumulation + micro) * self.micro_batch
                              for micro in range(self.accumulation))]

    def in_order(self, count: int) -> Iterator[tuple[dict, int, int]]:
        """The first `count` micro-batches of the rows in their order (evaluation: every rank runs as
        many), a short last one filled up to the micro-batch size."""
        for start in range(0, count * self.micro_batch, self.micro_batch):
            yield self.batch_of(list(range(start, min(start + self.micro_batch, len(self.plan)))), fill=True)


def steps_per_epoch(rows_per_rank: int, micro_batch: int, accumulation: int) -> int:
    return rows_per_rank // (micro_batch * accumulation)


def total_steps(max_steps: int, num_train_epochs: float, per_epoch: int) -> int:
    import math

    return max_steps if max_steps > 0 else max(1, math.ceil(num_train_epochs * per_epoch))
