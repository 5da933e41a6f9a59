"""Names in a run directory that the control plane and the worker both read."""
from __future__ import annotations

# In every complete checkpoint-<step>/ directory, written last (with the files' checksums): a
# checkpoint without it was cut short while saving.
CHECKPOINT_MARKER = "complete"
