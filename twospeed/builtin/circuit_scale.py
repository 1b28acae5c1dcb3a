"""Keeps the built circuits (builtin/copy_circuit.py, builtin/flag_circuit.py) at the scale of the residual around them
while the rest of the model trains.

Why: a built head writes and matches at the scale it was built for, but the learnt part of the residual grows
~20x in a build (layer 0's outputs come to dominate it; the embeddings grow ~2x). After RMSNorm a built head's
share then fades: the previous-token heads blur over their neighbours, a key written at the start is lost in
the copy layer's norm, and the refusal circuit's match falls under its sink. So each step the trainer measures
the learnt coordinates' RMS at every layer's input and at the final norm, and rescales the held weights:

- relative entries by RMS now / RMS at the first step: a positional query and key that read a constant
  embedding entry after layer 0's norm keep their score;
- absolute entries to the RMS where they are read: the refusal circuit writes its reserved coordinates at
  the residual's own scale.

The RMS is measured over the learnt coordinates only. An output that lands there is not scaled: it would grow
the RMS it is scaled by, and that loop diverges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twospeed.builtin.train_llama import TrainLlama


@dataclass(slots=True)
class Scaled:
    weight: torch.Tensor
    index: tuple
    base: torch.Tensor  # the built value
    point: int  # where it is read: layer i's input, or len(layers) for the final norm
    absolute: bool = False


class CircuitScale:
    """Measures the residual's scale in the forward pass (hooks) and applies it to held weights (`apply`)."""

    def __init__(self, model: TrainLlama, free: int):
        self.free = free  # the learnt coordinates come first; reserved ones (never grown) are left out
        self.entries: list[Scaled] = []
        self.rms: list[float] = []
        self.first: list[float] = []
        layers = model.model.layers
        self.hooks = [layer.register_forward_pre_hook(self._measure(i)) for i, layer in enumerate(layers)]
        self.hooks.append(model.model.norm.register_forward_pre_hook(self._measure(len(layers))))
        self.rms = [1.0] * (len(layers) + 1)

    def _measure(self, i: int):
        def hook(module, args) -> None:
            self.rms[i] = args[0][..., :self.free].detach().float().pow(2).mean().sqrt().item()
            if len(self.first) <= i:
                self.first.append(self.rms[i])
        return hook

    def add(self, weight: torch.Tensor, index: tuple, point: int, absolute: bool = False) -> None:
        self.entries.append(Scaled(weight, index, weight.detach()[index].clone(), point, absolute))

    def apply(self) -> None:
        if len(self.first) < len(self.rms):
            return  # no forward pass measured yet
        with torch.no_grad():
            for e in self.entries:
                factor = self.rms[e.point] if e.absolute else self.rms[e.point] / self.first[e.point]
                e.weight[e.index] = e.base * factor

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def level_embeddings(weight: torch.Tensor, cols: slice) -> None:
    """Give every token's learnt embedding (`cols`) the same norm, the mean of theirs.

    Why: layer 0's built positional heads (previous token, this token) read a constant embedding entry after the
    norm, so a token whose learnt embedding grew larger than its neighbours' gets a weaker query and key, and
    its neighbour wins its attention (measured: ';' at 1.09 against 0.61-0.88 around it, and the heads looked
    one token off there). With equal norms every token looks alike to them; the logits' scale is the final
    norm's to learn."""
    with torch.no_grad():
        part = weight[:, cols]
        norms = part.norm(dim=1, keepdim=True).clamp_min(1e-8)
        part.mul_(norms.mean() / norms)
