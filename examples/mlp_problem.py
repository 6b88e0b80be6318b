"""The problem of the training examples, in plain torch: the MLP's sizes, its initial weights
and each step's batch.

train_dp_tp.py and train_elastic.py train it on a tensorplay mesh; bench/recovery_job_torch.py
trains the same (2, 4) "dp" x "tp" MLP on plain torch.distributed (torchrun's restart-the-world
side of bench/recovery.py). This module imports torch only, so that job imports nothing of
tensorplay.
"""

from __future__ import annotations

import torch

MESH_SHAPE, MESH_NAMES = (2, 4), ("dp", "tp")
D_IN, HIDDEN, D_OUT = 16, 32, 8  # HIDDEN must be a multiple of the "tp" size
BATCH = 16  # the global batch of one step, split over the "dp" rows
LR, SEED = 0.5, 0
DTYPE = torch.float64  # float64 keeps the examples' checks far above rounding noise


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The initial full W1, W2 (the same on every rank: same seed)."""
    gen = torch.Generator().manual_seed(SEED)
    w1 = torch.randn(D_IN, HIDDEN, generator=gen, dtype=DTYPE) / D_IN**0.5
    return w1, torch.randn(HIDDEN, D_OUT, generator=gen, dtype=DTYPE) / HIDDEN**0.5


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s full batch (inputs, targets), the same on every rank and in any mesh."""
    gen = torch.Generator().manual_seed(SEED + 1 + step)
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(SEED + 1000),
                          dtype=DTYPE)
    x = torch.randn(BATCH, D_IN, generator=gen, dtype=DTYPE)
    return x, torch.tanh(x @ teacher)
