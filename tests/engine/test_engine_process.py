"""The engine process's side of the wire, driven in-process: it loads no tokenizer and no
processor, and serves the prompt exactly as the API process processed it (token ids, M-RoPE
positions with a video's time spacing, pixels through shared memory), token for token with the
offline LLM on the same checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import zmq

from tests.conftest import video_frame
from vlmserve import LLM, SamplingParams
from vlmserve.api.frontend import load_frontend
from vlmserve.engine import engine_process
from vlmserve.engine.checkpoint import load_engine_model
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.engine.engine_process import EngineLoop, HeartbeatThread
from vlmserve.ipc import shm
from vlmserve.ipc.contracts import EngineCoreOutput
from vlmserve.ipc.messages import (
    AddLoRA,
    AddRequest,
    Heartbeat,
    ListLoRAs,
    LoRAReply,
    Ready,
    RemoveLoRA,
    RequestFailed,
    encoder,
    from_engine_decoder,
)
from vlmserve.lora import LoRAError, LoRARequest
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, VideoInput

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


class Push:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=32 << 20)


def _message(request_id: str, prompt, params: SamplingParams) -> AddRequest:  # type: ignore[no-untyped-def]
    """What the API process sends: the prompt without its pixels, which go to shared memory."""
    segments = [shm.write_array(item.pixel_values.numpy()) for item in prompt.mm_items]
    items = [dataclasses.replace(item, pixel_values=torch.empty(0)) for item in prompt.mm_items]
    wire = dataclasses.replace(prompt, prompt=None, mm_items=items)
    return AddRequest(request_id, [request_id], [params], wire, segments)


def _run(core: EngineCore) -> list[EngineCoreOutput]:
    outputs = []
    for _ in range(200):
        if not core.has_unfinished_requests():
            return outputs
        outputs.extend(core.step())
    raise AssertionError("the request did not finish in 200 steps")


@pytest.fixture(scope="module")
def bare25(tiny25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen2.5-VL checkpoint with every tokenizer file removed."""
    bare = tmp_path_factory.mktemp("bare") / "tiny-qwen2_5-vl-no-tokenizer"
    shutil.copytree(tiny25_dir, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    return bare


def test_engine_without_tokenizer_files_serves_an_image_and_video_prompt_as_offline(
    tiny25_dir: Path, bare25: Path, images: dict
) -> None:
    with pytest.raises(FileNotFoundError):
        load_frontend(_engine_config(bare25))  # the API side could not even start from it
    frontend = load_frontend(_engine_config(tiny25_dir))
    frames = [video_frame(i, 56, 56) for i in range(8)]
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "What happens?<|im_end|>\n<|im_start|>assistant\n"
    )
    # 8 frames at 1 fps: 2 s per temporal patch, so Qwen2.5-VL's temporal positions step by 2 * 4.
    video = VideoInput(np.stack(frames), VideoOptions(sample_fps=1.0))
    prompt = frontend.processor.process(text, [ImageInput(images["wide"])], [video])
    assert prompt.mm_items[1].second_per_grid_t == 2.0
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)

    core = EngineCore(_engine_config(bare25), load_engine_model(_engine_config(bare25), frontend.eos_token_ids))
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    message = _message("r", prompt, params)
    loop._handle(encoder.encode(message))
    assert push.sent == [] and core.has_unfinished_requests()
    assert not any(Path("/dev/shm", s.name).exists() for s in message.segments)  # read and unlinked
    served = _run(core)

    llm = LLM(str(tiny25_dir), dtype="float32", max_model_len=2048, kv_cache_memory_gib=0.03)
    offline = llm.generate(
        {
            "prompt": text,
            "multi_modal_data": {"image": images["wide"], "video": np.stack(frames)},
            "mm_processor_kwargs": {"sample_fps": 1.0},
        },
        params,
    )[0].outputs[0]
    assert [t for o in served for t in o.new_token_ids] == offline.token_ids
    assert offline.logprobs is not None
    for o, expected in zip(served, offline.logprobs, strict=True):
        assert o.logprobs is not None
        assert abs(o.logprobs[0].logprob - expected[o.new_token_ids[0]].logprob) < 1e-5


def test_engine_refuses_a_prompt_whose_pixels_are_missing(tiny_dir: Path, images: dict) -> None:
    frontend = load_frontend(_engine_config(tiny_dir))
    core = EngineCore(_engine_config(tiny_dir), load_engine_model(_engine_config(tiny_dir), frontend.eos_token_ids))
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>x<|im_end|>\n<|im_start|>assistant\n"
    prompt = frontend.processor.process(text, [ImageInput(images["odd"])])
    message = _message("r", prompt, SamplingParams(max_tokens=2))
    gone = message.segments[0].name
    shm.unlink(gone)
    loop._handle(encoder.encode(message))
    (reply,) = [from_engine_decoder.decode(raw) for raw in push.sent]
    assert isinstance(reply, RequestFailed) and reply.request_id == "r"
    assert not core.has_unfinished_requests()


def test_heartbeats_keep_coming_while_the_step_loop_is_busy_in_one_long_call() -> None:
    """A long step (here: matmuls until three heartbeats have arrived, or 60 s) is not silence:
    the heartbeat comes from a thread of its own, on a socket of its own."""
    context = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/from-engine"
    pull = context.socket(zmq.PULL)
    pull.bind(address)
    beats: list[object] = []
    three = threading.Event()

    def receive() -> None:
        while len(beats) < 3 and pull.poll(60_000):
            beats.append(from_engine_decoder.decode(pull.recv()))
        three.set()

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    heartbeat = HeartbeatThread(context, address)
    heartbeat.start()
    try:
        a = torch.randn(256, 256)
        deadline = time.monotonic() + 60
        while not three.is_set() and time.monotonic() < deadline:  # one "step" the loop never leaves
            a = torch.tanh(a @ a)
    finally:
        heartbeat.stopped.set()
        heartbeat.join(10)
    assert beats == [Heartbeat(os.getpid())] * 3
    assert not heartbeat.is_alive()
    receiver.join(10)
    pull.close(linger=0)
    context.term()  # returns only once the heartbeat thread has closed its socket


class AdapterCore:
    """The engine core's adapter calls (and what EngineLoop reads when it is built)."""

    num_prompt_tokens = num_generation_tokens = 0
    spec_stats = SimpleNamespace(copy=lambda: None)

    def __init__(self) -> None:
        self.loras: dict[str, LoRARequest] = {}

    def add_lora(self, lora: LoRARequest) -> None:
        if lora.lora_path.endswith("wide"):
            raise LoRAError(f"adapter {lora.lora_name!r}: rank 64 is above max_lora_rank 16")
        if lora.lora_path.endswith("broken"):
            raise RuntimeError("/srv/internal/detail")
        self.loras[lora.lora_name] = lora

    def remove_lora(self, lora_name: str) -> bool:
        return self.loras.pop(lora_name, None) is not None

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())


def test_adapter_calls_are_answered_by_call_id_with_the_engines_reason_for_a_refusal() -> None:
    push = Push()
    loop = EngineLoop(AdapterCore(), None, push, os.getppid())  # type: ignore[arg-type]
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    for message in [
        AddLoRA(1, a),
        AddLoRA(2, b),
        AddLoRA(3, LoRARequest("w", 3, "/adapters/wide")),
        AddLoRA(4, LoRARequest("x", 4, "/adapters/broken")),
        RemoveLoRA(5, "a"),
        RemoveLoRA(6, "a"),
        ListLoRAs(7),
    ]:
        loop._handle(encoder.encode(message))
    replies = [from_engine_decoder.decode(raw) for raw in push.sent]
    assert replies == [
        LoRAReply(1),
        LoRAReply(2),
        LoRAReply(3, error="adapter 'w': rank 64 is above max_lora_rank 16"),
        LoRAReply(4, error="the engine's adapter call raised RuntimeError"),  # our error: its text stays in the log
        LoRAReply(5, removed=True),
        LoRAReply(6, removed=False),
        LoRAReply(7, loras=[b]),
    ]


def test_an_adapter_that_cannot_be_read_stops_a_first_start_and_not_a_restart(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--lora-modules at the first start: a bad adapter stops it naming why; a restarted engine
    (--restarted) leaves it out and serves (a request naming it gets the reason)."""
    config = _engine_config(tiny_dir)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "media_limits"}
    fields["enable_lora"] = True
    gone = LoRARequest("gone", 1, str(tmp_path / "deleted-adapter"))
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/from-engine"
    pull.bind(address)
    argv = ["--config", json.dumps(fields), "--input", f"ipc://{tmp_path}/to-engine", "--output", address]
    argv += ["--parent", "1", "--lora-modules", msgspec.json.encode([gone]).decode()]  # parent 1: exits once ready
    try:
        assert engine_process.main(argv) == 1
        assert "the engine cannot start: adapter 'gone'" in caplog.text and "deleted-adapter" in caplog.text
        assert not pull.poll(0)  # never ready
        assert engine_process.main([*argv, "--restarted"]) == 0
        assert "adapter 'gone'" in caplog.text and "not loaded again" in caplog.text
        received = []  # its heartbeats, and Ready
        while pull.poll(1000):
            received.append(type(from_engine_decoder.decode(pull.recv())))
        assert Ready in received
    finally:
        pull.close(linger=0)
        context.term()
