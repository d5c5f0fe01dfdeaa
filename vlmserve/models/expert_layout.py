"""Which way round a checkpoint stores a stacked expert weight.

vlmserve holds a stacked expert weight as [experts, out, in] (each expert a Linear's weight).
Checkpoints come both ways round: transformers 4.x held stacked experts as [experts, in, out] (a
bmm's layout; the published Qwen3-VL-MoE checkpoints, written by 4.57, store them so), while
transformers 5's MoE layers hold [experts, out, in] and its save_pretrained writes them as held
(checked for 5.23 and 5.24). What tells a tensor's layout, in this order:

1. its own shape, unless its in and out sizes are equal (a square tensor reads both ways);
2. the shapes of the checkpoint's other stacked expert tensors, which one writer stored one way
   (for a SwiGLU expert, gate_up_proj [2 * intermediate, hidden] and down_proj [hidden,
   intermediate] cannot both be square, so a complete checkpoint always has such a tensor);
3. config.json's `transformers_version`: the release that wrote the checkpoint.

Where none tells, the tensor is refused with its name, its shape and the two shapes it could be.
"""

from __future__ import annotations

import enum
import re

import torch


class ExpertLayout(enum.Enum):
    OUT_IN = "[experts, out, in]"
    IN_OUT = "[experts, in, out]"


def layout_written_by(transformers_version: str | None) -> ExpertLayout | None:
    """The stacked-expert layout the transformers release named in config.json saves; None when
    it names none (or not as a release number)."""
    match = re.match(r"(\d+)\.", transformers_version or "")
    if match is None:
        return None
    return ExpertLayout.IN_OUT if int(match.group(1)) < 5 else ExpertLayout.OUT_IN


def _in_out(out_in: tuple[int, ...]) -> tuple[int, ...]:
    experts, out_size, in_size = out_in
    return (experts, in_size, out_size)


class CheckpointExpertLayouts:
    """The layouts of one checkpoint's stacked expert tensors, learned as they are read: a tensor
    whose shape tells is oriented at once; a square one waits for resolve(), after the others."""

    def __init__(self, transformers_version: str | None) -> None:
        self.transformers_version = transformers_version
        self.seen: dict[ExpertLayout, str] = {}  # layout -> the first tensor seen in it

    def layout_of(self, name: str, tensor: torch.Tensor, out_in: tuple[int, ...]) -> ExpertLayout | None:
        """The layout of checkpoint tensor `name` whose [experts, out, in] shape would be `out_in`;
        None when its shape reads both ways. Any other shape is refused."""
        shape = tuple(tensor.shape)
        in_out = _in_out(out_in)
        if shape == out_in == in_out:
            return None
        for layout, expected in ((ExpertLayout.OUT_IN, out_in), (ExpertLayout.IN_OUT, in_out)):
            if shape == expected:
                self.seen.setdefault(layout, name)
                return layout
        raise ValueError(
            f"weight {name}: checkpoint shape {shape}, model expects {out_in} {ExpertLayout.OUT_IN.value} "
            f"or {in_out} {ExpertLayout.IN_OUT.value}"
        )

    def resolve(self, name: str, tensor: torch.Tensor) -> ExpertLayout:
        """The layout of a square tensor, once every other tensor of the checkpoint has been read."""
        if len(self.seen) == 1:
            return next(iter(self.seen))
        by_version = layout_written_by(self.transformers_version)
        if by_version is not None:
            return by_version
        shape = tuple(tensor.shape)
        if self.seen:
            others = (
                "its other stacked expert tensors are stored both ways ("
                + ", ".join(f"{seen} as {layout.value}" for layout, seen in self.seen.items())
                + ")"
            )
        else:
            others = "it has no other stacked expert tensor whose shape tells"
        version = (
            f"transformers_version {self.transformers_version!r} is not a release number"
            if self.transformers_version
            else "no transformers_version"
        )
        raise ValueError(
            f"weight {name}: checkpoint shape {shape} fits both {shape} {ExpertLayout.OUT_IN.value} "
            f"(transformers 5's save_pretrained) and {shape} {ExpertLayout.IN_OUT.value} (transformers 4.x, the "
            f"published checkpoints), as its in and out sizes are equal; {others}, and config.json has {version}. "
            f'Set "transformers_version" in config.json to the release that wrote the checkpoint (4.x: '
            f"{ExpertLayout.IN_OUT.value}, 5.x: {ExpertLayout.OUT_IN.value})"
        )


def to_out_in(tensor: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """A stacked expert tensor in `layout` -> [experts, out, in]."""
    return tensor.transpose(1, 2) if layout is ExpertLayout.IN_OUT else tensor
