"""msgspec (msgpack) for the engine's plain-data contracts, tensors included.

The contracts (SchedulerOutput, ModelRunnerOutput, the engine core's requests and outputs) are
msgspec structs and dataclasses; the only values msgspec does not know are torch tensors (pixel
patches, M-RoPE positions). They travel as a msgpack extension:

    [dtype code: 1 byte][ndim: 1 byte][shape: ndim little-endian int64][the raw bytes, C order]

No pickle anywhere: decoding builds only the declared types."""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgspec
import torch

_TENSOR_EXT = 1
# Code -> dtype; bfloat16 travels as its raw 16-bit words.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}

T = TypeVar("T")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        code = _CODES.get(tensor.dtype)
        if code is None:
            raise TypeError(f"no wire form for {tensor.dtype} tensors")
        header = struct.pack(f"<BB{tensor.dim()}q", code, tensor.dim(), *tensor.shape)
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor  # numpy has no bfloat16
        return msgspec.msgpack.Ext(_TENSOR_EXT, header + raw.numpy().tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR_EXT or len(data) < 2:
        raise msgspec.ValidationError(f"unknown extension type {code}")
    dtype_code, ndim = data[0], data[1]
    if dtype_code >= len(_DTYPES):
        raise msgspec.ValidationError(f"unknown tensor dtype code {dtype_code}")
    dtype = _DTYPES[dtype_code]
    start = 2 + 8 * ndim
    shape = struct.unpack_from(f"<{ndim}q", data, 2)
    body = bytearray(data[start:])  # a private, writable copy
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    count = 1
    for n in shape:
        count *= n
    if len(body) != count * torch.empty((), dtype=storage).element_size():
        raise msgspec.ValidationError(f"tensor of shape {list(shape)} does not match its {len(body)} bytes")
    tensor = torch.frombuffer(body, dtype=storage).reshape(shape) if count else torch.empty(shape, dtype=storage)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise NotImplementedError(f"cannot decode {type_}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any) -> bytes:
    return encoder.encode(obj)


def decoder(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder of `type_` (a struct, dataclass or union of them), tensors included."""
    return msgspec.msgpack.Decoder(type_, dec_hook=_dec_hook, ext_hook=_ext_hook)
