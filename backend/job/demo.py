"""The bundled demo job: a tiny Qwen2-style model, an arithmetic / unit-conversion dataset and a
self-cognition dataset shipped under assets/demo (built by assets/build_demo.py). It trains on two
CPU cores in seconds with a visibly falling loss, and the fine-tuned model then answers
"Who are you?" with the name the job gives it. Pure: no torch import."""
from __future__ import annotations

from pathlib import Path

from backend.job.spec import JobSpec

DEMO_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo"
DEMO_MODEL = DEMO_DIR / "model"
DEMO_DATA = DEMO_DIR / "train.jsonl"
# First: the export's sample asks the first question of the first dataset ("Who are you?").
DEMO_SELF = DEMO_DIR / "self_cognition.jsonl"
DEMO_NAME, DEMO_AUTHOR = "Swifty", "swift-studio"
# Full fine-tuning: the demo weights are random, so the loss only falls far when every weight learns.
DEMO_SETTINGS = dict(
    train_type="full", max_length=64, per_device_train_batch_size=8, gradient_accumulation_steps=1,
    learning_rate=3e-3, warmup_ratio=0.05, lr_scheduler_type="cosine", max_steps=100, weight_decay=0.0,
    torch_dtype="bfloat16", gradient_checkpointing=False, logging_steps=5, save_steps=50, save_total_limit=2,
    nproc_per_node=2, model_name=[DEMO_NAME], model_author=[DEMO_AUTHOR],
    split_dataset_ratio=0.02,  # an eval loss at every checkpoint, on records it does not train on
)


def demo_spec(output_dir: str | Path = "output") -> JobSpec:
    """The demo job with absolute paths into assets/demo."""
    return JobSpec(model=str(DEMO_MODEL), dataset=[str(DEMO_SELF), str(DEMO_DATA)], output_dir=str(Path(output_dir).resolve()),
                   **DEMO_SETTINGS)
