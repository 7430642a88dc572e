"""Fitting FlashMoE's eviction network (paper 003, Table 1) to the rows of eviction_samples.

The features are integers in disguise (r, f, max f), so many samples share an input; samples
with equal inputs are merged into one row weighted by their count with their mean target, which leaves
the MSE and its gradient unchanged and makes an epoch cheap. Network: 2 -> 128 -> 128 -> 1 with SiLU
(Table 1), MSE loss, AdamW lr 1e-3, weight decay 1e-2, batches of 4,096 merged rows, fixed seed, early
stopping on a validation split (the eviction moments of the last ``val_fraction`` of each trace's kept
tokens). ``per_layer`` trains one network per MoE layer on the samples of that layer's experts (the
paper's "per-layer ML cache FFN"; targets still ranked over the whole cache, so that the networks' scores
compare), all traces then needing the same number of layers. CPU, PyTorch imported here only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moe_offload.errors import ConfigError
from moe_offload.policies.learned_model import FEATURE_NAMES

HIDDEN = (128, 128)  # paper 003, Table 1: 3 linear layers, hidden size 128


@dataclass
class MergedRows:
    """Samples with equal inputs merged: x [U, 2], mean target y [U], count w [U]; ``within`` is the sum of
    squared deviations from the row means (the part of the MSE no network can remove)."""

    x: np.ndarray
    y: np.ndarray
    w: np.ndarray
    within: float

    @classmethod
    def of(cls, inputs: np.ndarray, targets: np.ndarray) -> "MergedRows":
        packed = np.ascontiguousarray(inputs, dtype=np.float32).view(np.int64)[:, 0]  # both floats, exactly
        unique, first, index = np.unique(packed, return_index=True, return_inverse=True)
        index = index.reshape(-1)
        w = np.bincount(index, minlength=unique.size).astype(np.float64)
        y = np.bincount(index, weights=targets, minlength=unique.size) / w
        within = float(((targets - y[index]) ** 2).sum())
        return cls(x=inputs[first], y=y, w=w, within=within)

    def mse(self, prediction: np.ndarray) -> float:
        """The MSE over the original samples of a prediction per merged row."""
        return float(((prediction - self.y) ** 2 * self.w).sum() + self.within) / float(self.w.sum())


@dataclass
class Fit:
    layers: list
    history: list
    best_epoch: int
    train_loss: float
    validation_loss: float
    epochs_run: int
    stopped: str


def fit_network(torch, train_m: MergedRows, val_m: MergedRows, *, epochs: int, patience: int, batch_size: int, seed: int,
         deadline: float | None, say: Callable[[str], None]) -> Fit:
    """Weighted-MSE training of the paper's network on merged rows, early stopping on ``val_m``."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    widths = (len(FEATURE_NAMES), *HIDDEN, 1)
    modules = []
    for i in range(len(widths) - 1):
        modules.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            modules.append(torch.nn.SiLU())
    net = torch.nn.Sequential(*modules)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)

    x = torch.from_numpy(train_m.x)
    y = torch.from_numpy(train_m.y.astype(np.float32))
    w = torch.from_numpy(train_m.w.astype(np.float32))
    rows = x.shape[0]
    scale = float(rows) / float(train_m.w.sum())  # E[batch loss] = the MSE over all samples
    xv = torch.from_numpy(val_m.x)

    def predict(inputs) -> np.ndarray:
        with torch.no_grad():
            return net(inputs)[:, 0].double().numpy()

    best_loss, best_epoch, best_state = math.inf, 0, None
    history = []
    epoch = 0
    stopped = "maximum epochs reached"
    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(rows, generator=generator)
        for first in range(0, rows, batch_size):
            batch = order[first:first + batch_size]
            err = net(x[batch])[:, 0] - y[batch]
            loss = (w[batch] * err * err).sum() * (scale / batch.shape[0])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        net.eval()
        train_mse, val_mse = train_m.mse(predict(x)), val_m.mse(predict(xv))
        history.append((epoch, train_mse, val_mse))
        if val_mse < best_loss - 1e-7:
            best_loss, best_epoch = val_mse, epoch
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if epoch == 1 or epoch % 10 == 0:
            say(f"epoch {epoch:4d}  train MSE {train_mse:.6f}  validation MSE {val_mse:.6f}")
        if epoch - best_epoch >= patience:
            stopped = f"early stop, no validation improvement in {patience} epochs"
            break
        if deadline is not None and time.perf_counter() > deadline:
            stopped = "time limit reached"
            break
    if best_state is None:  # the validation loss was never finite
        raise ConfigError("training diverged: the validation loss is not a finite number")
    net.load_state_dict(best_state)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().numpy().astype(np.float32), m.bias.detach().numpy().astype(np.float32))
              for m in linears]
    return Fit(layers=layers, history=history, best_epoch=best_epoch, train_loss=history[best_epoch - 1][1],
                validation_loss=best_loss, epochs_run=epoch, stopped=stopped)
