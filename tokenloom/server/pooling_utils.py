"""How the pooling endpoints encode what they return (vLLM 0.32's vllm/entrypoints/pooling/utils.py and
vllm/utils/serial_utils.py, same names and layout):

    float        a JSON list of numbers
    base64       the vector's bytes in `embed_dtype` and `endianness` (float32, native: what OpenAI's client
                 decodes), base64 text in the JSON
    bytes        the raw bytes of every output, one after the other, as the body (application/octet-stream);
                 a `metadata` header (JSON: id, created, model, usage, and per output its index, dtype,
                 endianness, byte range and shape) says how to cut it
    bytes_only   the same body without the header (the client knows the shapes)

embed_dtype: float32, float16, bfloat16, fp8_e4m3, fp8_e5m2 (bfloat16 travels as its 16 bits, fp8 as bytes).
"""

from __future__ import annotations

import base64
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import Response

# embed_dtype -> (the torch dtype the values are cast to, the numpy dtype their bits are read as).
_EMBED_DTYPE_NAMES = {
    "float32": ("float32", np.float32),
    "float16": ("float16", np.float16),
    "bfloat16": ("bfloat16", np.float16),
    "fp8_e4m3": ("float8_e4m3fn", np.uint8),
    "fp8_e5m2": ("float8_e5m2", np.uint8),
}
EMBED_DTYPES: dict[str, int] = {name: np.dtype(view).itemsize for name, (_, view) in _EMBED_DTYPE_NAMES.items()}
ENDIANNESS = ("native", "big", "little")


def _swapped(endianness: str) -> bool:
    return endianness != "native" and endianness != sys.byteorder


def tensor2binary(data: Any, embed_dtype: str, endianness: str) -> bytes:
    """The values of `data` (a torch tensor or a numpy array) as `embed_dtype` bytes, flattened."""
    import torch

    torch_name, view = _EMBED_DTYPE_NAMES[embed_dtype]
    tensor = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
    cast = tensor.to(getattr(torch, torch_name)).flatten().contiguous()
    array = cast.view(getattr(torch, np.dtype(view).name)).numpy()  # numpy has no bfloat16 / fp8: their bits
    if _swapped(endianness):
        array = array.byteswap()
    return array.tobytes()


def binary2tensor(binary: bytes, shape: tuple[int, ...], embed_dtype: str, endianness: str) -> Any:
    """tensor2binary's inverse: a torch tensor of `embed_dtype`."""
    import torch

    torch_name, view = _EMBED_DTYPE_NAMES[embed_dtype]
    array = np.frombuffer(binary, dtype=view).reshape(shape)
    if _swapped(endianness):
        array = array.byteswap()
    return torch.from_numpy(array.copy()).view(getattr(torch, torch_name))


@dataclass
class MetadataItem:
    index: int
    embed_dtype: str
    endianness: str
    start: int
    end: int
    shape: tuple[int, ...]


def build_metadata_items(embed_dtype: str, endianness: str, shape: tuple[int, ...],
                         n_request: int) -> list[MetadataItem]:
    """What a `bytes_only` body holds, for outputs of one known shape."""
    n_bytes = EMBED_DTYPES[embed_dtype]
    size = math.prod(shape)
    return [MetadataItem(i, embed_dtype, endianness, i * size * n_bytes, (i + 1) * size * n_bytes, shape)
            for i in range(n_request)]


def decode_pooling_output(items: list[MetadataItem], body: bytes) -> list[Any]:
    return [binary2tensor(body[item.start: item.end], tuple(item.shape), item.embed_dtype, item.endianness)
            for item in sorted(items, key=lambda x: x.index)]


def encode_pooling_output_float_or_ndarray(output: Any) -> Any:
    """vLLM's: the output as a numpy array where the JSON encoder can write one, else a list."""
    try:
        data = output.outputs.data
        if hasattr(data, "is_contiguous") and not data.is_contiguous():
            data = data.contiguous()
        return data if isinstance(data, np.ndarray) else data.numpy()
    except (RuntimeError, TypeError):
        return output.outputs.data.tolist()


def encode_output(data: Any, encoding_format: str, embed_dtype: str, endianness: str) -> Any:
    """One output in a JSON response: a list of floats, or base64 text of its bytes."""
    if encoding_format == "base64":
        return base64.b64encode(tensor2binary(data, embed_dtype, endianness)).decode("ascii")
    return np.asarray(data, dtype=np.float32).tolist()


def usage(outputs: list[Any]) -> dict[str, Any]:
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def bytes_response(outputs: list[Any], request_id: str, created: int, model: str, encoding_format: str,
                   embed_dtype: str, endianness: str) -> Response:
    """vLLM's build_pooling_bytes_streaming_response: the outputs' bytes back to back; with `bytes`, the
    `metadata` header that says where each one is."""
    body, items, offset = [], [], 0
    for index, out in enumerate(outputs):
        data = np.asarray(out.outputs.data)
        binary = tensor2binary(data, embed_dtype, endianness)
        items.append({"index": index, "embed_dtype": embed_dtype, "endianness": endianness, "start": offset,
                      "end": offset + len(binary), "shape": list(data.shape)})
        body.append(binary)
        offset += len(binary)
    headers = None
    if encoding_format == "bytes":
        metadata = {"id": request_id, "created": created, "model": model, "data": items,
                    "usage": {k: v for k, v in usage(outputs).items() if k in ("prompt_tokens", "total_tokens")}}
        headers = {"metadata": json.dumps(metadata)}
    return Response(b"".join(body), headers=headers, media_type="application/octet-stream")
