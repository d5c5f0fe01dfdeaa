"""Model weights moved into huge-page memory (models/huge_pages.py): same values, same sharing,
in a mapping the kernel may back with 2 MiB pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from vlmserve.models.huge_pages import MIN_BYTES, huge_pages_available, move_to_huge_pages

needs_huge_pages = pytest.mark.skipif(
    not huge_pages_available(), reason="transparent huge pages are off here (/sys/kernel/mm/transparent_hugepage)"
)


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry (its header line and fields) of the mapping holding `address`."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            if entry is not None:
                return entry
            if start <= address < end:
                entry = {"range": head}
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(1024, 1024)  # 4 MiB weight, 4 KiB bias (stays)
        self.embed = nn.Embedding(3000, 256)  # 3 MB, shared with head
        self.head = nn.Linear(256, 3000, bias=False)
        self.head.weight = self.embed.weight
        # a buffer viewing the second half of proj's weight: shares its memory
        self.register_buffer("lower_half", self.proj.weight.data[512:], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x)[:, :256])


@needs_huge_pages
def test_large_tensors_move_into_one_huge_page_mapping_with_their_values_and_sharing() -> None:
    model = _Model()
    x = torch.randn(5, 1024)
    before = {name: t.detach().clone() for name, t in model.state_dict(keep_vars=True).items()}
    expected = model(x)
    bias_ptr = model.proj.bias.data_ptr()

    moved = move_to_huge_pages(model)

    assert moved >= (4 << 20) + 3000 * 256 * 4  # proj.weight and the shared embedding, once each
    for name, tensor in model.state_dict(keep_vars=True).items():
        assert torch.equal(tensor, before[name]), name
    assert torch.equal(model(x), expected)
    # the small bias stays where it was; the large tensors live in one advised mapping
    assert model.proj.bias.data_ptr() == bias_ptr
    mapping = _mapping_of(model.proj.weight.data_ptr())
    assert mapping["range"] == _mapping_of(model.embed.weight.data_ptr())["range"]
    assert mapping["THPeligible"] == "1"
    assert model.proj.weight.data_ptr() % (2 << 20) == 0  # the first tensor on a huge-page boundary
    # sharing kept: tied weights are one tensor, the view still views (a write shows through)
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.lower_half.data_ptr() == model.proj.weight.data_ptr() + 512 * 1024 * 4
    with torch.no_grad():
        model.proj.weight[600, 3] = 42.0
    assert model.lower_half[88, 3].item() == 42.0


@needs_huge_pages
def test_small_tensors_and_the_off_switch_leave_memory_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    small = nn.Linear(64, 64)
    assert small.weight.untyped_storage().nbytes() < MIN_BYTES
    ptr = small.weight.data_ptr()
    assert move_to_huge_pages(small) == 0
    assert small.weight.data_ptr() == ptr

    monkeypatch.setenv("VLMSERVE_HUGE_PAGES", "0")
    model = _Model()
    ptr = model.proj.weight.data_ptr()
    assert move_to_huge_pages(model) == 0
    assert model.proj.weight.data_ptr() == ptr


@needs_huge_pages
def test_a_built_cpu_model_streams_its_weights_from_huge_pages(tiny_dir: Path) -> None:
    from vlmserve.entrypoints.llm import LLM

    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2)
    model = llm.llm_engine.model
    head = model.lm_head.weight
    assert head.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, still
    assert _mapping_of(head.data_ptr())["THPeligible"] == "1"
