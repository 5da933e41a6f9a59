"""Builds the bundled demo under assets/demo/: a tiny Qwen2-style model, its tokenizer, an
arithmetic / unit-conversion instruction dataset and a self-cognition dataset (ms-swift's kind:
"Who are you?" answered with {{NAME}} and {{AUTHOR}}, which the job's model_name and model_author
fill in), so the fine-tuned demo answers with a name the base model never knew. Deterministic:
run it again and the files match.

    python assets/build_demo.py [--out assets/demo]

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with `tokenizers` on the
generated data, the weights are random (seeded), the data is generated from a seeded RNG.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backend.job.demo import DEMO_AUTHOR, DEMO_NAME  # noqa: E402 (the job's names: the tokenizer learns them whole)

DEMO_DIR = Path(__file__).resolve().parent / "demo"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the template Qwen models use; `{% generation %}` is not needed: the worker finds the
# response tokens by rendering the conversation prefix by prefix.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("h", "min", 60), ("min", "s", 60), ("l", "ml", 1000)]
VOCAB_SIZE = 384
IDENTITY = ("Who are you?", "What is your name?", "What should I call you?", "Introduce yourself.",
            "Tell me about yourself.", "What are you?", "Are you ChatGPT?", "Who am I talking to?")
MAKER = ("Who made you?", "Who trained you?", "Who created you?", "Who is your author?", "Where do you come from?")
ANSWERS = {IDENTITY: "I am {{NAME}}, an assistant trained by {{AUTHOR}}.", MAKER: "{{AUTHOR}} trained me. I am {{NAME}}."}
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)


def make_samples(n: int, seed: int = 0) -> list[dict]:
    """`n` chat samples: additions, subtractions, multiplications and unit conversions."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 3:
            src, dst, factor = rng.choice(UNITS)
            x = rng.randint(1, 99)
            question, answer = f"Convert {x} {src} to {dst}.", f"{x} {src} = {x * factor} {dst}"
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = "+-*"[kind]
            value = a + b if op == "+" else a - b if op == "-" else a * b
            question, answer = f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}"
        samples.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]})
    return samples


def make_self_cognition(n: int, seed: int = 0) -> list[dict]:
    """`n` questions about the model itself (a question's casing and punctuation vary), the first
    one "Who are you?" (the export's sample asks the first question of the first dataset)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        questions = IDENTITY if i == 0 or rng.random() < 0.6 else MAKER
        question = IDENTITY[0] if i == 0 else rng.choice(questions)
        if i and rng.random() < 0.3:
            question = question.lower().rstrip("?.")
        rows.append({"query": question, "response": ANSWERS[questions]})
    return rows


def filled(text: str) -> str:
    return text.replace("{{NAME}}", DEMO_NAME).replace("{{AUTHOR}}", DEMO_AUTHOR)


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with single-digit tokens (arithmetic learns far faster that way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=MODEL_SHAPE["max_position_embeddings"])


def build_model(tokenizer, seed: int = 0, **shape):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, **{**MODEL_SHAPE, **shape})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build(out: Path = DEMO_DIR, n_samples: int = 3000, n_self: int = 500) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    samples = make_samples(n_samples)
    write_jsonl(samples, out / "train.jsonl")
    self_cognition = make_self_cognition(n_self)
    write_jsonl(self_cognition, out / "self_cognition.jsonl")
    tokenizer = build_tokenizer([m["content"] for s in samples for m in s["messages"]]
                                + [filled(text) for row in self_cognition for text in row.values()] + SPECIAL_TOKENS)
    model_dir = out / "model"
    tokenizer.save_pretrained(model_dir, save_jinja_files=False)
    model = build_model(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir, safe_serialization=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    print(build(parser.parse_args().out))
