"""argparse types that refuse a bad value with a message naming it (argparse turns the message
into `vlmserve CMD: error: argument --FLAG: ...`, exit code 2). Standard library only: the
command line checks its arguments before torch is imported."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def max_logprobs(text: str) -> int:
    """vLLM's --max-logprobs: a count, or -1 (the vocabulary's size)."""
    value = _int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the whole vocabulary) or 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1..65535, got {text}")
    return value


def existing_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def limit_mm_per_prompt(text: str) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt: a JSON object of modality -> items one request may hold."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object like \'{{"image": 4, "video": 1}}\', got {text!r}')
    for modality, count in value.items():
        if modality not in ("image", "video"):
            raise argparse.ArgumentTypeError(f"unknown modality {modality!r}; image and video are served")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{modality}: expected a non-negative integer, got {count!r}")
    return value


def _json_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` holds; None where it holds no object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def speculative_config(text: str) -> dict[str, object]:
    """vLLM's --speculative-config: a JSON object, checked as the engine will read it."""
    from vlmserve.engine.speculative import SpeculativeConfig

    value = _json_object(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like \'{{"method": "ngram", "num_speculative_tokens": 4}}\', got {text!r}'
        )
    try:
        SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def hf_overrides(text: str) -> dict[str, object]:
    """vLLM's --hf-overrides: a JSON object of keys over the checkpoint's config.json (a pooling
    model reads classifier_from_token, is_matryoshka and matryoshka_dimensions from it)."""
    value = _json_object(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like \'{{"architectures": ["Qwen3VLForSequenceClassification"], '
            f'"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}}\', got {text!r}'
        )
    return value


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter of `--lora-modules` (vLLM's LoRAModulePath): what requests call it, its folder
    (adapter_config.json + adapter_model.safetensors), and the served model it is listed under
    (None: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


LORA_MODULE_FIELDS = ("name", "path", "base_model_name")


def lora_module(text: str) -> LoRAModulePath:
    """vLLM's --lora-modules word: `name=path`, or a JSON object {"name": ..., "path": ...,
    "base_model_name": ...} (base_model_name optional). Its form only: the server checks that the
    folder exists before it loads the model, and the engine what is in it when it starts."""
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        module = LoRAModulePath(name.strip(), path.strip())
    else:
        value = _json_object(text)
        if value is None:
            raise argparse.ArgumentTypeError(
                f'expected NAME=PATH or a JSON object like \'{{"name": "sql", "path": "/adapters/sql"}}\', got {text!r}'
            )
        unknown = sorted(set(value) - set(LORA_MODULE_FIELDS))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown field {', '.join(map(repr, unknown))} (the fields: {', '.join(LORA_MODULE_FIELDS)})"
            )
        for key in LORA_MODULE_FIELDS:
            if (
                key in value
                and not isinstance(value[key], str)
                and not (key == "base_model_name" and value[key] is None)
            ):
                raise argparse.ArgumentTypeError(f"{text!r}: {key} must be a string, got {value[key]!r}")
        module = LoRAModulePath(value.get("name", ""), value.get("path", ""), value.get("base_model_name"))
    if not module.name or not module.path:
        raise argparse.ArgumentTypeError(f"{text!r}: an adapter needs a name and a path (NAME=PATH)")
    return LoRAModulePath(module.name, os.path.expanduser(module.path), module.base_model_name)


def network(text: str) -> str:
    """CIDR[:PORT] (IPv6 in brackets when a port is given): checked here, parsed by the server."""
    try:
        network_and_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not CIDR[:PORT] ({e})") from None
    return text


def network_and_port(spec: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]:
    """As the server reads --allow-media-network."""
    cidr, _, port_text = spec.rpartition(":") if spec.count(":") == 1 or spec.endswith("]") else (spec, "", "")
    net = ipaddress.ip_network((cidr or spec).strip("[]"), strict=False)
    if port_text and not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(f"port {port_text!r} is not 1..65535")
    return net, int(port_text) if port_text else None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def add_kernel_flags(parser: argparse.ArgumentParser) -> None:
    """--attention-backend and --quantization, the same for `serve` and `chat`."""
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="attention kernels (default: auto, i.e. triton on CUDA when the triton package is installed, else torch)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["int8", "awq", "gptq"],
        help="linear layers' weights: int8 (weight-only, made at load from a float checkpoint); awq, gptq "
        "(4-bit checkpoints, found from config.json when left out; default: as the checkpoint holds them)",
    )


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size and the many-machines flags (each defaulting to its environment
    variable, as torchrun's), the same for `serve`, `chat` and `worker`."""
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="ranks the model is split over, on all nodes together: one process each (one CUDA device each)",
    )
    parser.add_argument(
        "--nnodes",
        type=positive_int,
        default=os.environ.get("VLMSERVE_NNODES") or "1",  # a string default goes through `type`
        help="machines the ranks are spread over, evenly (default: $VLMSERVE_NNODES, else 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=non_negative_int,
        default=os.environ.get("VLMSERVE_NODE_RANK") or "0",
        help="this machine's index: 0 runs the engine (serve, chat), 1.. run `vlmserve worker` "
        "(default: $VLMSERVE_NODE_RANK, else 0)",
    )
    parser.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR") or "127.0.0.1",
        help="node 0's address, where the ranks meet (default: $MASTER_ADDR, else 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        type=port,
        default=os.environ.get("MASTER_PORT") or None,
        help="the TCP port on node 0 where the ranks meet; needed with --nnodes above 1 "
        "(default: $MASTER_PORT, else a free one)",
    )


def parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    """add_parallel_flags' values as EngineConfig / LLM fields."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
    }
