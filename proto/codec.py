"""Converts torch tensors to and from the wire's TensorRef (dtype, shape, inline bytes or region slice)."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Callable

import torch

from dspark_sidecar.proto import sidecar_pb2 as pb

# The wire format is little-endian raw bytes and this codec copies memory as is, so it is only
# correct on little-endian hosts (x86-64, arm64, and every GPU host the sidecar targets).
if sys.byteorder != "little":
    raise ImportError("dspark_sidecar.proto.codec assumes a little-endian host")

# torch dtype <-> wire DType, one to one. float8_e4m3fnuz (gfx942's FP8) is deliberately absent:
# it encodes different values under the same bits, so it must never pass as DTYPE_FP8_E4M3.
_TO_PROTO: dict[torch.dtype, int] = {
    torch.bfloat16: pb.DTYPE_BF16,
    torch.float16: pb.DTYPE_FP16,
    torch.float32: pb.DTYPE_FP32,
    torch.int32: pb.DTYPE_INT32,
    torch.int64: pb.DTYPE_INT64,
    torch.float8_e4m3fn: pb.DTYPE_FP8_E4M3,
    torch.uint8: pb.DTYPE_UINT8,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}

# A region payload is resolved by the server's data plane (it owns the mapped buffers):
# resolver(region, dtype, shape, field) -> tensor of that dtype and shape.
RegionResolver = Callable[[pb.RegionSlice, torch.dtype, tuple[int, ...], str], torch.Tensor]

# torch.frombuffer warns that a read-only buffer gives a writable-looking tensor. Here that is by
# design (see from_tensor_ref). The warning is a C++ TORCH_WARN_ONCE: it fires once per process
# whatever Python's filters say, so spend it here, at import, under a local "ignore". A filter
# kept in place instead would be thread-unsafe (catch_warnings per call) or undone by test
# harnesses that reset the filters, and `-W error` would then turn the first decode into a crash.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0", dtype=torch.uint8)


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The wire DType value of a torch dtype; ValueError if the wire has no such dtype."""
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire DType") from None


def dtype_from_proto(value: int, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a wire DType value; ValueError naming `field` if unset or unknown."""
    try:
        return _FROM_PROTO[value]
    except KeyError:
        name = pb.DType.Name(value) if value in pb.DType.values() else str(value)
        raise ValueError(f"{field}: unsupported dtype {name}") from None


def to_tensor_ref(t: torch.Tensor) -> pb.TensorRef:
    """An inline TensorRef holding `t`'s elements (copied to host and made contiguous if needed)."""
    dtype = dtype_to_proto(t.dtype)
    host = t.detach().to("cpu").contiguous()
    # reshape(-1) first: viewing as uint8 changes the element size, which torch refuses on 0-d
    # tensors; the uint8 view also lets numpy export bf16/fp8, which numpy has no dtype for.
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
    return pb.TensorRef(dtype=dtype, shape=list(host.shape), data=raw)


def region_tensor_ref(
    dtype: torch.dtype, shape: tuple[int, ...] | list[int], region_id: int, offset_bytes: int
) -> pb.TensorRef:
    """A TensorRef pointing at `prod(shape) * itemsize` bytes of a registered region."""
    return pb.TensorRef(
        dtype=dtype_to_proto(dtype),
        shape=list(shape),
        region=pb.RegionSlice(region_id=region_id, offset_bytes=offset_bytes),
    )


# The most dimensions a TensorRef may name (a step's tensors have 1 or 2; torch's GPU kernels
# take 25). A peer's shape of many huge dimensions made prod(shape) a bigint that grows with every factor:
# quadratic time (a 540 KB shape: 11 s; a 256 MiB answer, the shim's receive limit: hours), and an error
# message whose number Python refuses to print past 4300 digits (a ValueError that named no field).
MAX_DIMS = 64


def shape_text(shape) -> str:
    """A peer's shape as a message quotes it: listed up to MAX_DIMS dimensions, past that only counted.
    Listed whole, a shape of millions of dimensions took seconds and gigabytes of Python ints (at 256 MiB,
    over a minute) for a message then clipped to 1 KiB (server/errors.py), on the rank's step lock."""
    n = len(shape)
    return str(list(shape)) if n <= MAX_DIMS else f"of {n} dimensions"


def nbytes_of(ref: pb.TensorRef, field: str) -> int:
    """Bytes the tensor `ref` describes (prod(shape) * itemsize); ValueError on a bad dtype/shape."""
    dtype = dtype_from_proto(ref.dtype, field)
    if len(ref.shape) > MAX_DIMS:
        raise ValueError(f"{field}: shape has {len(ref.shape)} dimensions, at most {MAX_DIMS}")
    shape = tuple(ref.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{field}: negative dimension in shape {list(shape)}")
    return math.prod(shape) * dtype.itemsize


def from_tensor_ref(
    ref: pb.TensorRef,
    field: str,
    *,
    expect_dtype: torch.dtype | None = None,
    writable: bool = False,
    resolver: RegionResolver | None = None,
) -> torch.Tensor:
    """The CPU tensor a TensorRef carries; every error is a ValueError that names `field`.

    Inline payloads are zero-copy: reading the bytes field already hands us a private copy of
    the payload (upb builds a new `bytes` object on each access), and the tensor aliases it.
    Python bytes are immutable, so that tensor must be treated as read-only: writing through
    it would mutate a `bytes` object (for 1-byte payloads, a CPython-wide cached singleton).
    Callers that write in place pass `writable=True` and get a clone.

    Region payloads are resolved by `resolver` (the server's data plane); without one they are
    refused.
    """
    nbytes = nbytes_of(ref, field)
    dtype = dtype_from_proto(ref.dtype, field)
    shape = tuple(ref.shape)
    if expect_dtype is not None and dtype != expect_dtype:
        raise ValueError(f"{field}: dtype must be {expect_dtype}, got {dtype}")
    kind = ref.WhichOneof("payload")
    if kind == "region":
        if resolver is None:
            raise ValueError(
                f"{field}: region payload (region {ref.region.region_id}) needs the data plane's "
                "resolver; this codec decodes inline bytes only"
            )
        return resolver(ref.region, dtype, shape, field)
    if kind != "data":
        raise ValueError(f"{field}: no payload (neither data nor region is set)")
    data = ref.data
    if len(data) != nbytes:
        raise ValueError(
            f"{field}: payload has {len(data)} bytes, shape {list(shape)} of {dtype} needs {nbytes}"
        )
    if nbytes == 0:
        # torch.frombuffer refuses empty buffers. An empty shape can still name dimensions whose
        # strides overflow int64 ([0, 2**62, 4]): torch raises RuntimeError for it, which escaped as no
        # ValueError (the shim took a sidecar's such answer for a bug of its own, not a malformed answer).
        try:
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as err:
            raise ValueError(f"{field}: shape {list(shape)} cannot be laid out ({err})") from None
    t = torch.frombuffer(data, dtype=dtype).reshape(shape)
    return t.clone() if writable else t
