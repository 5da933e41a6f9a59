"""Long sequences on one GPU, from the engines that ship them: DeepSpeed's TiledMLP (Arctic Long
Sequence Training) runs each decoder layer's MLP over tiles of the sequence, and transformers'
activation checkpointing with offload keeps the checkpointed layer inputs in pinned host memory
(torch's save_on_cpu)."""
from __future__ import annotations

import math

import torch

from launcher.config import ConfigError


def tile_count(seq_len: int, hidden_size: int) -> int:
    """How many tiles a row of `seq_len` tokens is cut into: about `hidden_size` tokens each, as
    ALST does (a tile's intermediate activations then take about what one hidden state of the whole
    row does). Exactly the number of pieces `torch.chunk` makes of it: DeepSpeed marks the weights'
    gradients ready on the tile it counts as the last."""
    wanted = max(1, math.ceil(seq_len / hidden_size))
    size = math.ceil(seq_len / wanted)
    return math.ceil(seq_len / size)


def tile_mlps(layers: list[torch.nn.Module], hidden_size: int) -> None:
    """Each layer's `mlp` forward, as it is (Liger's or LoRA-adapted), run by TiledMLP."""
    import launcher.engines.zero  # noqa: F401  first: it imports deepspeed without mlflow
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ConfigError(f"tiled_mlp: decoder layer {i} ({type(layer).__name__}) has no 'mlp' to tile; turn "
                              "tiled_mlp off")
        forward = mlp.forward
        drops = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())

        def tiled(x, mlp=mlp, forward=forward, drops=drops):
            # One function per call: TiledMLP keeps it for that call's backward. The weights are
            # read at each call: LoRA, DeepSpeed and FSDP2 may have replaced them.
            fn = TileRandomness(forward) if drops and mlp.training else (lambda _, part: forward(part))
            return TiledMLP.apply(fn, mlp, x, tile_count(x.shape[-2], hidden_size), list(mlp.parameters()))

        mlp.forward = tiled


class TileRandomness:
    """An MLP forward for TiledMLP that draws the same dropout masks for a tile in backward as in
    forward. DeepSpeed 0.19's TiledMLP computes each tile again in backward without the random
    state its forward drew from, so a dropout inside the MLP (peft's LoRA dropout) would draw other
    masks and the gradients would not be the forward's (tests/test_long_sequence.py pins both):
    the state before each forward tile is kept and put back for that tile's backward. (Under
    checkpointing the backward is the recompute's, whose tiles draw what the first forward drew:
    torch's checkpoint puts the random state back.)"""

    def __init__(self, forward):
        self.forward = forward
        self._states: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._replayed = 0

    def __call__(self, _mlp, part: torch.Tensor) -> torch.Tensor:
        cuda = part.device if part.is_cuda else None
        if not torch.is_grad_enabled():  # TiledMLP's forward runs its tiles without grad
            self._states.append((torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda else None))
            return self.forward(part)
        cpu_state, cuda_state = self._states[self._replayed]
        self._replayed += 1
        with torch.random.fork_rng(devices=[cuda.index] if cuda else []):
            torch.set_rng_state(cpu_state)
            if cuda:
                torch.cuda.set_rng_state(cuda_state, cuda)
            return self.forward(part)


def enable_checkpointing(model, offload: bool) -> None:
    """Gradient checkpointing of every decoder layer (torch's non-reentrant checkpoint); with
    `offload`, what it saves (each layer's input: layers x tokens x hidden) lives in pinned host
    memory until backward. torch >= 2.11 saves a checkpoint's inputs through the saved-tensor hooks
    that save_on_cpu installs (seen on 2.11 and 2.13: tests/test_long_sequence.py)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=offload)
