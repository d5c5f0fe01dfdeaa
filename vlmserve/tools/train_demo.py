"""Train the demo checkpoint: a small Qwen2-VL that describes, counts, locates and grounds the
shapes vlmserve.tools.scenes draws, on the CPU, in well under an hour on 2 cores.

    python -m vlmserve.tools.train_demo [--steps N] [--out vlmserve/tools/demo/demo_compact.safetensors]

Needs `pip install -e ".[test]"` (the model is transformers' Qwen2VLForConditionalGeneration,
trained with autograd; vlmserve itself only runs it). Seeded and deterministic on one machine:
scenes come from `random.Random(seed + step)`, the weights from torch.manual_seed(seed).

The vocabulary trick: only a few hundred of Qwen's 151,936 token ids ever appear in the training
conversations. The embedding is trained for those ids only, and the output layer over those ids
plus ONE shared row standing for each of the N unused ids, its logit raised by log(N): exactly the
full softmax of a head whose unused rows are all equal to it. The compact file holds the used rows,
that shared row and every other weight; vlmserve.tools.demo_checkpoint expands it into the
published layout (unused lm_head rows = the shared row, unused embedding rows zero).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmserve.multimodal.image import process_image
from vlmserve.tools import scenes
from vlmserve.tools.demo_checkpoint import (
    COMPACT_PATH,
    DEMO_IMAGE_PROCESSOR,
    IMAGE_TOKENS,
    PICTURE_SIDE,
    SYSTEM_PROMPT,
    write_layout,
)

# How often each question kind is picked for a turn (ground and ground_all carry the hard part).
KIND_WEIGHTS = {
    "describe": 3,
    "count": 1,
    "colour": 1,
    "shape": 1,
    "position": 2,
    "ground": 3,
    "ground_all": 2,
    "text": 2,
}
IMAGE_PAD_ID = 151655
TURNS = 3  # questions per picture: the vision tower runs once for three answers
PICTURE_SIZES = (168, 336, 448)  # drawn at these sizes; the processor resizes each to 168 x 168


def prompt_head(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{'<|image_pad|>' * IMAGE_TOKENS}<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def next_turn(question: str) -> str:
    return f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def pick_turns(qas: list[scenes.QA], rng: random.Random, turns: int = TURNS) -> list[scenes.QA]:
    pool = list(qas)
    out: list[scenes.QA] = []
    while pool and len(out) < turns:
        qa = rng.choices(pool, weights=[KIND_WEIGHTS[q.kind] for q in pool])[0]
        pool.remove(qa)
        out.append(qa)
    return out


class Conversations:
    """Scenes turned into token ids, labels (-100 outside answers) and patches."""

    def __init__(self, tokenizer_dir: Path, turns: int = TURNS) -> None:
        from tokenizers import Tokenizer

        self.turns = turns
        self.tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def example(self, rng: random.Random) -> tuple[list[int], list[int], torch.Tensor, list[str]]:
        scene = scenes.random_scene(rng)
        turns = pick_turns(scenes.questions(scene, rng), rng, self.turns)
        picture = scenes.draw(scene, rng.choice(PICTURE_SIZES))
        ids: list[int] = []
        labels: list[int] = []
        kinds: list[str] = []
        for k, qa in enumerate(turns):
            head = self.encode(prompt_head(qa.question) if k == 0 else next_turn(qa.question))
            answer = self.encode(qa.answer + "<|im_end|>")
            ids += head + answer
            labels += [-100] * len(head) + answer
            kinds += [""] * len(head) + [qa.kind] * len(answer)
        patches = torch.from_numpy(process_image(picture, DEMO_IMAGE_PROCESSOR).pixel_values)
        return ids, labels, patches, kinds


def used_token_ids(conv: Conversations, samples: int = 4000) -> list[int]:
    """Every id the training conversations hold (a fixed sample covers the templates' words and
    every digit), plus the chat template's special tokens."""
    rng = random.Random(12345)
    ids: set[int] = set(conv.encode("<|endoftext|><|im_start|><|im_end|><|vision_start|><|vision_end|><|image_pad|>"))
    ids |= set(conv.encode("0123456789"))
    for _ in range(samples):
        scene = scenes.random_scene(rng)
        for qa in scenes.questions(scene, rng):
            ids |= set(conv.encode(prompt_head(qa.question) + qa.answer + "<|im_end|>" + next_turn(qa.question)))
        for q in scenes.DESCRIBE_QUESTIONS:
            ids |= set(conv.encode(prompt_head(q)))
    return sorted(ids)


class CompactEmbedding(nn.Module):
    """An embedding over the used ids; every other id maps to one extra (zero, frozen) row."""

    index: torch.Tensor

    def __init__(self, used: list[int], vocab_size: int, hidden: int) -> None:
        super().__init__()
        index = torch.full((vocab_size,), len(used), dtype=torch.long)
        index[torch.tensor(used)] = torch.arange(len(used))
        self.register_buffer("index", index, persistent=False)
        self.weight = nn.Parameter(torch.randn(len(used), hidden) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = torch.cat([self.weight, self.weight.new_zeros(1, self.weight.shape[1])])
        return table[self.index[ids]]


def collate(batch: list[tuple[list[int], list[int], torch.Tensor, list[str]]], pad: int) -> dict[str, Any]:
    longest = max(len(ids) for ids, *_ in batch)
    input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    kinds: list[list[str]] = []
    for row, (ids, lab, _, kd) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
        kinds.append(kd + [""] * (longest - len(kd)))
    side = DEMO_SPEC_GRID
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "pixel_values": torch.cat([p for *_, p, _ in batch]),
        "image_grid_thw": torch.tensor([[1, side, side]] * len(batch)),
        "kinds": kinds,
    }


DEMO_SPEC_GRID = PICTURE_SIDE // 14


class Trainer:
    def __init__(self, seed: int, work: Path) -> None:
        from transformers import AutoConfig, Qwen2VLForConditionalGeneration

        torch.manual_seed(seed)
        write_layout(work, weights=None)
        self.conv = Conversations(work)
        self.used = used_token_ids(self.conv)
        config = AutoConfig.from_pretrained(work)
        config._attn_implementation = "sdpa"
        self.model = Qwen2VLForConditionalGeneration(config).float()
        lm = self.model.model.language_model
        hidden = config.text_config.hidden_size
        self.vocab = config.text_config.vocab_size
        lm.embed_tokens = CompactEmbedding(self.used, self.vocab, hidden)
        self.target = torch.full((self.vocab,), -100, dtype=torch.long)
        self.target[torch.tensor(self.used)] = torch.arange(len(self.used))
        # Output rows for the used ids, then the shared row of the unused ones.
        self.head = nn.Parameter(torch.randn(len(self.used) + 1, hidden) * 0.02)
        self.model.lm_head = nn.Identity()  # not used: the loss below applies self.head
        self.log_unused = math.log(self.vocab - len(self.used))

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.model.parameters() if p.requires_grad] + [self.head]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.head.t()
        return torch.cat([logits[..., :-1], logits[..., -1:] + self.log_unused], dim=-1)

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            mm_token_type_ids=(batch["input_ids"] == IMAGE_PAD_ID).int(),
        )
        hidden = out.last_hidden_state[:, :-1]
        labels = batch["labels"][:, 1:]
        keep = labels != -100
        target = self.target[labels[keep]]
        logits = self.logits(hidden[keep])
        return nn.functional.cross_entropy(logits, target), logits.argmax(-1) == target, keep

    def compact_weights(self) -> dict[str, torch.Tensor]:
        """The shipped form: every weight but the vocabulary tables as published names, and the
        used rows (`demo.embed_rows`, `demo.head_rows`), the shared row (`demo.other_row`) and
        the used ids (`demo.used_ids`)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.model.named_parameters():
            if "embed_tokens" in name:
                continue
            out[_published_name(name)] = p.detach().to(torch.bfloat16).contiguous()
        out["demo.embed_rows"] = self.model.model.language_model.embed_tokens.weight.detach().to(torch.bfloat16)
        out["demo.head_rows"] = self.head.detach()[:-1].to(torch.bfloat16).contiguous()
        out["demo.other_row"] = self.head.detach()[-1].to(torch.bfloat16).contiguous()
        out["demo.used_ids"] = torch.tensor(self.used, dtype=torch.int32)
        return out


def _published_name(name: str) -> str:
    """transformers 5's module names -> the names Qwen2-VL checkpoints publish."""
    if name.startswith("language_model."):
        return "model." + name[len("language_model.") :]
    return name  # visual.*


def make_batch(conv: Conversations, seed: int, step: int, batch_size: int) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + step)
    return collate([conv.example(rng) for _ in range(batch_size)], pad=151643)


def evaluate(trainer: Trainer, seed: int, batches: int, batch_size: int) -> dict[str, float]:
    """Teacher-forced token accuracy per question kind on scenes the training never draws
    (another seed), and the share of answers right in every token."""
    right: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    trainer.model.eval()
    with torch.no_grad():
        for b in range(batches):
            batch = make_batch(trainer.conv, seed, b, batch_size)
            _, ok, keep = trainer.loss(batch)
            kinds = [
                k
                for row, m in zip(batch["kinds"], keep, strict=True)
                for k, kept in zip(row[1:], m.tolist(), strict=True)
                if kept
            ]
            for kind, good in zip(kinds, ok.tolist(), strict=True):
                right[kind][0] += good
                right[kind][1] += 1
    trainer.model.train()
    return {kind: r / n for kind, (r, n) in sorted(right.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.tools.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=COMPACT_PATH)
    parser.add_argument(
        "--turns", type=int, default=TURNS, help="questions per picture (1: every answer must look at the picture)"
    )
    parser.add_argument("--init", type=Path, default=None, help="start from a state --save-state wrote")
    parser.add_argument("--save-state", type=Path, default=None, help="also save the float32 training state here")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(args.seed, Path(work))
    trainer.conv.turns = args.turns
    if args.init is not None:  # a second stage: start from a saved state
        state = torch.load(args.init, weights_only=True)
        if state["used"] != trainer.used:
            raise SystemExit(f"{args.init} was trained over other token ids")
        trainer.model.load_state_dict(state["model"])
        with torch.no_grad():
            trainer.head.copy_(state["head"])
    params = trainer.parameters()
    print(
        f"{sum(p.numel() for p in params) / 1e6:.2f}M trained parameters, {len(trainer.used)} used token ids, "
        f"{args.steps} steps of {args.batch_size} pictures x {args.turns} questions",
        flush=True,
    )
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98)
    )
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = make_batch(trainer.conv, args.seed, step, args.batch_size)
        loss, ok, _ = trainer.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if step == 0 else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % args.log_every == 0 or step == 0:
            print(
                f"step {step + 1}/{args.steps} loss {running:.4f} token acc {ok.float().mean():.3f} "
                f"lr {lr_at(step):.2e} {time.monotonic() - start:.0f}s",
                flush=True,
            )
    accuracy = evaluate(trainer, args.seed + 1_000_000, batches=8, batch_size=args.batch_size)
    print("held-out teacher-forced token accuracy: " + json.dumps({k: round(v, 4) for k, v in accuracy.items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    if args.save_state is not None:  # everything, in float32, to resume or re-export
        torch.save(
            {"model": trainer.model.state_dict(), "head": trainer.head.detach(), "used": trainer.used}, args.save_state
        )

    meta = {"steps": str(args.steps), "seed": str(args.seed), "final_loss": f"{running:.4f}"}
    save_file(trainer.compact_weights(), str(args.out), metadata=meta)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.monotonic() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
