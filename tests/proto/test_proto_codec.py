"""Round trips and refusals of the torch <-> TensorRef codec."""

from __future__ import annotations

import zlib

import pytest
import torch

from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb

ALL_DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64,
    torch.float8_e4m3fn, torch.uint8,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (0, 6144), (2, 0, 3), (7, 1, 3, 1), (1, 1, 1, 1, 13)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, shape)).encode()))
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    hi = 256 if dtype == torch.uint8 else 2**31 - 1
    lo = 0 if dtype == torch.uint8 else -(2**31)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns: exact, and NaN-safe for the float types.
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    t = _sample(dtype, shape)
    ref = codec.to_tensor_ref(t)
    assert ref.dtype == codec.dtype_to_proto(dtype)
    assert tuple(ref.shape) == shape
    assert len(ref.data) == t.numel() * t.element_size()
    # Through the wire format, not just the in-memory message.
    back = codec.from_tensor_ref(pb.TensorRef.FromString(ref.SerializeToString()), "x")
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(_bits(back), _bits(t))


def test_bf16_bytes_are_raw_little_endian():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    # bf16 1.0 = 0x3F80, -2.0 = 0xC000, stored low byte first.
    assert codec.to_tensor_ref(t).data == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_non_contiguous_and_offset_views_are_packed_c_contiguous():
    base = torch.arange(60, dtype=torch.int64).reshape(6, 10)
    view = base[1:5, ::3].t()  # strided, transposed, with a storage offset
    back = codec.from_tensor_ref(codec.to_tensor_ref(view), "positions")
    assert back.is_contiguous() and torch.equal(back, view)


def test_read_only_by_default_writable_gives_a_private_copy(monkeypatch):
    """Each read of ref.data is a new bytes object, so "a later decode still sees the old values" held
    without the copy too: writable=True must hand back memory of its own, not the tensor over the payload's
    bytes (writing through that mutates a bytes object, for 1-byte payloads CPython's cached singleton)."""
    over_bytes = []
    real = torch.frombuffer
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: over_bytes.append(real(*a, **k)) or over_bytes[-1])
    ref = codec.to_tensor_ref(torch.arange(4, dtype=torch.int32))
    a = codec.from_tensor_ref(ref, "seq_lens", writable=True)
    assert len(over_bytes) == 1 and a.data_ptr() != over_bytes[0].data_ptr()  # a copy, not the bytes
    a += 100
    b = codec.from_tensor_ref(ref, "seq_lens")
    assert len(over_bytes) == 2 and b.data_ptr() == over_bytes[1].data_ptr()  # zero-copy: the payload itself
    assert torch.equal(b, torch.arange(4, dtype=torch.int32))


def test_dtype_maps_are_inverse_and_cover_the_enum():
    values = {codec.dtype_to_proto(d) for d in ALL_DTYPES}
    assert values == set(pb.DType.values()) - {pb.DTYPE_UNSPECIFIED}
    for d in ALL_DTYPES:
        assert codec.dtype_from_proto(codec.dtype_to_proto(d)) == d


# The contract's table (proto/sidecar.proto, enum DType), written out here: the round trips above and
# dtype_to_proto/dtype_from_proto being inverse hold for any one-to-one map, so a codec that sent bf16
# as DTYPE_FP16 (or fp32 as DTYPE_INT32), decoding it back the same way, passed every test in tests/proto
# while a client built from the .proto alone would read those bytes as another type.
CONTRACT = {
    torch.bfloat16: "DTYPE_BF16", torch.float16: "DTYPE_FP16", torch.float32: "DTYPE_FP32",
    torch.int32: "DTYPE_INT32", torch.int64: "DTYPE_INT64", torch.float8_e4m3fn: "DTYPE_FP8_E4M3",
    torch.uint8: "DTYPE_UINT8",
}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_each_dtype_goes_on_the_wire_as_the_contract_names_it(dtype):
    wire = pb.DType.Value(CONTRACT[dtype])
    assert codec.to_tensor_ref(torch.zeros(2, dtype=dtype)).dtype == wire
    ref = pb.TensorRef(dtype=wire, shape=[2], data=b"\0" * (2 * torch.empty(0, dtype=dtype).element_size()))
    assert codec.from_tensor_ref(ref, "x").dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.bool, torch.int16, torch.float8_e4m3fnuz])
def test_unsupported_torch_dtype_raises(dtype):
    with pytest.raises(ValueError, match="no wire DType"):
        codec.to_tensor_ref(torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("value, shown", [(pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED"), (42, "42")])
def test_unknown_wire_dtype_raises_with_field(value, shown):
    ref = pb.TensorRef(dtype=value, shape=[2], data=b"\0" * 8)
    with pytest.raises(ValueError, match=rf"^block_tables: unsupported dtype {shown}$"):
        codec.from_tensor_ref(ref, "block_tables")


@pytest.mark.parametrize("nbytes", [0, 11, 13, 24])
def test_wrong_payload_size_raises_with_field(nbytes):
    # [3] int32 needs exactly 12 bytes.
    ref = pb.TensorRef(dtype=pb.DTYPE_INT32, shape=[3], data=b"\1" * nbytes)
    with pytest.raises(ValueError, match=rf"^seq_lens: payload has {nbytes} bytes.* needs 12$"):
        codec.from_tensor_ref(ref, "seq_lens")


def test_bf16_size_counts_two_bytes_per_element():
    ref = pb.TensorRef(dtype=pb.DTYPE_BF16, shape=[7, 4], data=b"\0" * 28)
    with pytest.raises(ValueError, match="inputs_embeds: payload has 28 bytes.* needs 56"):
        codec.from_tensor_ref(ref, "inputs_embeds")


def test_negative_dimension_raises_with_field():
    ref = pb.TensorRef(dtype=pb.DTYPE_INT64, shape=[-1, 2], data=b"")
    with pytest.raises(ValueError, match="slot_mapping: negative dimension"):
        codec.from_tensor_ref(ref, "slot_mapping")


@pytest.mark.parametrize("shape", [[0, 2**62, 4], [2**40, 2**40, 0, 2**40]], ids=str)
def test_an_empty_shape_torch_cannot_lay_out_is_a_value_error_naming_the_field(shape):
    """Zero elements, so an empty payload matches, but the other dimensions' strides overflow int64:
    torch.empty raised RuntimeError, outside the codec's contract (every error a ValueError naming the
    field), and a sidecar's answer so shaped reached the shim as an internal error, not a malformed answer."""
    ref = pb.TensorRef(dtype=pb.DTYPE_FP32, shape=shape, data=b"")
    with pytest.raises(ValueError, match=r"^hidden_states: shape .* cannot be laid out"):
        codec.from_tensor_ref(ref, "hidden_states", writable=True)


def test_expect_dtype_mismatch_raises_with_field():
    ref = codec.to_tensor_ref(torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match="positions: dtype must be torch.int64, got torch.int32"):
        codec.from_tensor_ref(ref, "positions", expect_dtype=torch.int64)
    assert codec.from_tensor_ref(ref, "seq_lens", expect_dtype=torch.int32).shape == (7,)


def test_missing_payload_raises_with_field():
    with pytest.raises(ValueError, match="input_ids: no payload"):
        codec.from_tensor_ref(pb.TensorRef(dtype=pb.DTYPE_INT64, shape=[7]), "input_ids")


def test_region_payload_needs_a_resolver():
    ref = codec.region_tensor_ref(torch.bfloat16, (14, 8), region_id=3, offset_bytes=256)
    assert ref.WhichOneof("payload") == "region"
    assert codec.nbytes_of(ref, "inputs_embeds") == 14 * 8 * 2
    with pytest.raises(ValueError, match="inputs_embeds: region payload \\(region 3\\)"):
        codec.from_tensor_ref(ref, "inputs_embeds")

    seen = []

    def resolver(region, dtype, shape, field):
        seen.append((region.region_id, region.offset_bytes, dtype, shape, field))
        return torch.ones(shape, dtype=dtype)

    out = codec.from_tensor_ref(ref, "inputs_embeds", resolver=resolver)
    assert seen == [(3, 256, torch.bfloat16, (14, 8), "inputs_embeds")]
    assert out.shape == (14, 8) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dims", [300, 100_000], ids=lambda d: f"{d}-dims")
def test_a_shape_of_very_many_huge_dimensions_is_refused_at_once_naming_the_field(dims):
    """prod(shape) over many dimensions of 2^62 is a bigint that grows with each factor: 100k of them
    took ~30 s (quadratic; a 256 MiB answer, the shim's receive limit, hours), and past ~230 of them the
    length mismatch's message raised Python's "Exceeds the limit (4300 digits)" ValueError, which named
    no field. A sidecar's answer so shaped must be a prompt malformed answer, like any other."""
    ref = pb.TensorRef(dtype=pb.DTYPE_FP32, shape=[2**62] * dims, data=b"\0" * 4)
    with pytest.raises(ValueError, match=rf"^hidden_states: shape has {dims} dimensions, at most {codec.MAX_DIMS}$"):
        codec.from_tensor_ref(ref, "hidden_states", writable=True)


def test_a_shape_of_max_dims_still_decodes():
    t = torch.arange(6, dtype=torch.float32).reshape([1] * (codec.MAX_DIMS - 1) + [6])
    assert torch.equal(codec.from_tensor_ref(codec.to_tensor_ref(t), "x"), t)


def test_the_dimension_limit_is_the_one_sidecar_proto_promises():
    """sidecar.proto tells every client "At most 64 entries" in a TensorRef's shape: a limit that moved below it
    refused a shape the contract allows, one above it took shapes the contract says are refused."""
    import re
    from pathlib import Path

    text = (Path(codec.__file__).parent / "sidecar.proto").read_text()
    promised = int(re.search(r"At most (\d+) entries \(proto/codec\.py MAX_DIMS\)", text).group(1))
    ok = pb.TensorRef(dtype=pb.DTYPE_FP32, shape=[1] * promised, data=b"\0" * 4)
    assert codec.from_tensor_ref(ok, "x").shape == (1,) * promised
    over = pb.TensorRef(dtype=pb.DTYPE_FP32, shape=[1] * (promised + 1), data=b"\0" * 4)
    with pytest.raises(ValueError, match=rf"^x: shape has {promised + 1} dimensions, at most {promised}$"):
        codec.from_tensor_ref(over, "x")


def test_shape_text_lists_every_shape_the_codec_accepts_and_counts_the_rest():
    """A refusal quotes any shape nbytes_of lets through in full (up to MAX_DIMS dimensions), longer ones by count."""
    assert codec.shape_text([3] * codec.MAX_DIMS) == str([3] * codec.MAX_DIMS)
    assert codec.shape_text([3] * (codec.MAX_DIMS + 1)) == f"of {codec.MAX_DIMS + 1} dimensions"


def test_a_one_dimensional_strided_view_is_packed_before_its_bytes_are_taken():
    """A column of a matrix (or x[::2]) is 1-D and not contiguous: flattening it is no copy, and viewing its
    elements as bytes needs a unit stride (torch's RuntimeError). The codec packs it first, whatever its rank."""
    base = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    for view in (base[:, 1], base.reshape(-1)[::5]):
        assert view.dim() == 1 and not view.is_contiguous()
        back = codec.from_tensor_ref(codec.to_tensor_ref(view), "slot_mapping")
        assert torch.equal(back, view)
