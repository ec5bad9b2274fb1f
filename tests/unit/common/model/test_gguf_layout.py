"""The GGUF layout check (common/model/gguf_layout.py) on damaged files: a header whose counts or lengths overrun the
file, tensor bytes past the end, shared between tensors or of an unknown type are refused with the file and the field
or tensor named, before `gguf.GGUFReader` (which trusts them) reads the file; an intact file passes, big-endian too."""

import struct

import numpy as np
import pytest

from grpo_stream.common.model.gguf_import import GgufError, convert_gguf
from grpo_stream.common.model.gguf_layout import check_layout

gguf = pytest.importorskip("gguf")


def text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<Q", len(raw)) + raw


def header(kvs: list[bytes], tensor_count: int = 0, kv_count: int | None = None) -> bytes:
    counts = struct.pack("<QQ", tensor_count, len(kvs) if kv_count is None else kv_count)
    return b"GGUF" + struct.pack("<I", 3) + counts + b"".join(kvs)


ARCH = text("general.architecture") + struct.pack("<I", 8) + text("llama")
DAMAGED_HEADERS = {
    "array length past the end": (header([ARCH, text("x.arr") + struct.pack("<IIQ", 9, 0, 100_000)]) + bytes(64),
                                  r"metadata field x\.arr's length=100000 cannot fit in the 64 bytes left"),
    "string length past the end": (header([ARCH, text("x.str") + struct.pack("<IQ", 8, 1 << 62) + b"abc"]),
                                   r"metadata field x\.str needs 4611686018427387904 bytes .* ends 3 bytes later"),
    "key/value count past the end": (header([ARCH], kv_count=1 << 60), r"GGUF\.kv_count=1152921504606846976 cannot"),
    "tensor count past the end": (header([ARCH], tensor_count=1 << 40), r"GGUF\.tensor_count=1099511627776 cannot"),
    "array of arrays": (header([text("x.nest") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 0, 0)]),
                        r"metadata field x\.nest's items has value type 9: an array of arrays"),
    "unknown value type": (header([text("x.odd") + struct.pack("<I", 77)]), r"metadata field x\.odd has value type 77"),
    "key repeated": (header([ARCH, ARCH]), r"metadata field general\.architecture is stated twice"),
    "not UTF-8": (header([text("x.s") + struct.pack("<IQ", 8, 2) + b"\xff\xfe"]), r"metadata field x\.s .* not UTF-8"),
    "cut inside a value": (header([ARCH])[:-3], r"metadata field general\.architecture needs 5 bytes"),
    "no magic": (b"GGML" + bytes(40), r"no GGUF magic number"),
    "too short": (b"GGUF", r"4 bytes is too short for a GGUF header"),
}


@pytest.mark.parametrize("case", list(DAMAGED_HEADERS))
def test_a_damaged_header_is_refused_by_name_before_it_is_read(tmp_path, case):
    data, match = DAMAGED_HEADERS[case]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    with pytest.raises(GgufError, match=rf"damaged\.gguf: {match}"):
        convert_gguf(path, tmp_path / "out", pad_token="<|endoftext|>")


def write_tensors(path, endianess=gguf.GGUFEndian.LITTLE) -> dict:
    """A GGUF of three tensors (F32, Q8_0, F16); returns name -> (byte offset of its type field, its data offset)."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_block_count(1)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((4, 32)).astype(np.float32))
    quantized = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("b.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", rng.standard_normal((3, 32)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.field.offset + 8 + len(t.name) + 4 + 8 * len(t.shape), t.data_offset - reader.data_offset)
            for t in reader.tensors}


def patched(path, at: int, fmt: str, value: int):
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def test_an_intact_file_passes_in_either_byte_order(tmp_path):
    write_tensors(tmp_path / "little.gguf")
    check_layout(tmp_path / "little.gguf")
    write_tensors(tmp_path / "big.gguf", gguf.GGUFEndian.BIG)
    check_layout(tmp_path / "big.gguf")


def test_tensor_bytes_past_the_end_are_refused(tmp_path):
    path = tmp_path / "cut.gguf"
    write_tensors(path)
    path.write_bytes(path.read_bytes()[:-100])  # the last part of a file carried in parts, lost or cut short
    with pytest.raises(GgufError, match=r"cut\.gguf: tensor c\.weight's 192 bytes at offset \d+ are past the end of "
                                        r"the file .* cut short"):
        convert_gguf(path, tmp_path / "out")
    entries = write_tensors(path)
    patched(path, entries["a.weight"][0] + 4, "<Q", 1 << 40)
    with pytest.raises(GgufError, match=r"tensor a\.weight's 512 bytes at offset \d+ are past the end"):
        check_layout(path)


def test_tensors_sharing_bytes_are_refused(tmp_path):
    """A damaged offset pointing into another tensor would be read as both, silently, by GGUFReader."""
    path = tmp_path / "overlap.gguf"
    entries = write_tensors(path)
    patched(path, entries["c.weight"][0] + 4, "<Q", entries["b.weight"][1])
    with pytest.raises(GgufError, match=r"overlap\.gguf: tensors (b\.weight and c\.weight|c\.weight and b\.weight) "
                                        r"share bytes"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("tensor,kind,match", [
    ("a.weight", 99, r"tensor a\.weight has type 99, which the gguf package does not know"),
    ("c.weight", 12, r"tensor c\.weight \(Q4_K\) has an innermost dimension of 32, not a whole number of its "
                     r"256-value blocks"),
])
def test_a_tensor_type_that_cannot_be_read_is_refused(tmp_path, tensor, kind, match):
    path = tmp_path / "kind.gguf"
    patched(path, write_tensors(path)[tensor][0], "<I", kind)
    with pytest.raises(GgufError, match=rf"kind\.gguf: {match}"):
        convert_gguf(path, tmp_path / "out")


def test_a_misaligned_tensor_is_refused(tmp_path):
    path = tmp_path / "align.gguf"
    entries = write_tensors(path)
    patched(path, entries["b.weight"][0] + 4, "<Q", entries["b.weight"][1] + 4)
    with pytest.raises(GgufError, match=r"tensor b\.weight's 136 bytes at offset \d+ are not aligned to 32 bytes"):
        check_layout(path)
