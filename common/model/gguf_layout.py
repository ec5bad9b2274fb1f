"""A GGUF file's layout checked before the `gguf` package's reader is trusted with it.

Why: `gguf.GGUFReader` believes every count and offset a file states. A string's length past the end of the file is
cut short without a word; an array said to hold 2**40 items past the end is looped over item by item, its memory
growing, for as long as that takes; a tensor's bytes may lie past the end (a part lost or cut short) or on top of
another tensor's, which is then read as both; a type it does not know is an error that names neither file nor
tensor. `check_layout` walks the header first, every count and length bounded by the bytes left, and refuses, with
the file and the field or tensor named, what llama.cpp's own loader (ggml's gguf.cpp) refuses: nested arrays, more
than 4 dimensions, unknown value or tensor types, a first dimension not a whole number of blocks, tensor data
misaligned, past the end or overlapping.
"""

from __future__ import annotations

import mmap
import pathlib
import struct

from grpo_stream.common.model.gguf_tokenizer import GgufError

STRING, ARRAY, UINT32 = 8, 9, 4
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF types
KEY_MIN_BYTES = 8 + 4 + 1  # the smallest key/value: an empty key's length, the type, a uint8
TENSOR_MIN_BYTES = 8 + 4 + 4 + 8  # the smallest tensor entry: an empty name's length, no dimensions, type, offset
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads the header front to back; every read is checked against the bytes left in the file."""

    def __init__(self, data: mmap.mmap, where: str):
        self.data, self.where, self.pos, self.order = data, where, 0, "<"

    def take(self, size: int, what: str) -> int:
        left = len(self.data) - self.pos
        if size > left:
            raise GgufError(f"{self.where}: {what} needs {size} bytes at offset {self.pos}, but the file ends {left} "
                            "bytes later (cut short or damaged)")
        self.pos += size
        return self.pos - size

    def number(self, code: str, what: str) -> int | float:
        return struct.unpack_from(self.order + code, self.data, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        size = self.number("Q", f"{what}'s length")
        start = self.take(size, what)
        try:
            return self.data[start:start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{self.where}: {what} (offset {start}) is not UTF-8 text") from None

    def new_name(self, seen: set[str], what: str, kind: str) -> str:
        """The next string, a name of `kind` ('metadata field', 'tensor') not in `seen` (then added): llama.cpp
        refuses a file that states one twice."""
        name = self.string(what)
        if name in seen:
            raise GgufError(f"{self.where}: {kind} {name} is stated twice")
        seen.add(name)
        return name

    def count(self, what: str, each: int) -> int:
        """A count of items of at least `each` bytes, refused when the rest of the file could not hold them."""
        value = self.number("Q", what)
        if value > (len(self.data) - self.pos) // each:
            raise GgufError(f"{self.where}: {what}={value} cannot fit in the {len(self.data) - self.pos} bytes left "
                            "(a damaged header)")
        return value


def _value(cur: _Cursor, kind: int, what: str, in_array: bool = False) -> object:
    """Reads one metadata value of GGUF type `kind`; returns it (None for an array)."""
    if kind == STRING:
        return cur.string(what)
    if kind in SCALARS:
        return cur.number(SCALARS[kind], what)
    if kind != ARRAY or in_array:
        why = "an array of arrays, which llama.cpp does not read" if kind == ARRAY else "not a GGUF value type"
        raise GgufError(f"{cur.where}: {what} has value type {kind}: {why}")
    item = cur.number("I", f"{what}'s item type")
    if item in SCALARS:
        size = struct.calcsize(SCALARS[item])
        cur.take(size * cur.count(f"{what}'s length", size), what)
        return None
    if item != STRING:
        return _value(cur, item, f"{what}'s items", in_array=True)  # refused: not a type an array may hold
    for index in range(cur.count(f"{what}'s length", 8)):
        cur.string(f"{what}[{index}]")
    return None


def check_layout(path: str | pathlib.Path) -> None:
    """Refuses a GGUF file whose header or tensor data `gguf.GGUFReader` would misread (module docstring)."""
    where, size = str(path), pathlib.Path(path).stat().st_size
    if size < 24:  # magic, version and the two counts
        raise GgufError(f"{where}: {size} bytes is too short for a GGUF header (cut short or empty)")
    with open(path, "rb") as file:
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cur = _Cursor(data, where)
            tensors, alignment = _header(cur)
            _check_tensors(where, tensors, -(-cur.pos // alignment) * alignment, alignment, len(data))


def _header(cur: _Cursor) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """The tensor entries (name, dimensions innermost first, type, offset) and the data alignment."""
    if cur.data[:4] != b"GGUF":
        raise GgufError(f"{cur.where}: no GGUF magic number at the start (not a GGUF file)")
    cur.take(4, "the magic number")
    if not cur.number("I", "GGUF.version") & 0xFFFF:  # written on a machine of the other byte order
        cur.order = ">"
    version = struct.unpack_from(cur.order + "I", cur.data, 4)[0]
    if version not in (2, 3):
        raise GgufError(f"{cur.where}: GGUF.version={version}; versions 2 and 3 are read")
    tensor_count, kv_count = cur.number("Q", "GGUF.tensor_count"), cur.count("GGUF.kv_count", KEY_MIN_BYTES)
    alignment, keys = DEFAULT_ALIGNMENT, set()
    for index in range(kv_count):
        key = cur.new_name(keys, f"metadata key #{index}", "metadata field")
        kind = cur.number("I", f"metadata field {key}'s type")
        value = _value(cur, kind, f"metadata field {key}")
        if key == "general.alignment":
            if kind != UINT32 or not value or value & (value - 1):
                raise GgufError(f"{cur.where}: metadata field general.alignment={value!r} (type {kind}) is not a "
                                "uint32 power of two")
            alignment = value
    if tensor_count > (len(cur.data) - cur.pos) // TENSOR_MIN_BYTES:
        raise GgufError(f"{cur.where}: GGUF.tensor_count={tensor_count} cannot fit in the {len(cur.data) - cur.pos} "
                        "bytes left (a damaged header)")
    tensors, names = [], set()
    for index in range(tensor_count):
        name = cur.new_name(names, f"tensor #{index}'s name", "tensor")
        dims = cur.number("I", f"tensor {name}'s dimension count")
        if dims > MAX_DIMS:
            raise GgufError(f"{cur.where}: tensor {name} has {dims} dimensions; GGUF tensors have at most {MAX_DIMS}")
        shape = [cur.number("Q", f"tensor {name}'s dimension {axis}") for axis in range(dims)]
        kind = cur.number("I", f"tensor {name}'s type")
        tensors.append((name, shape, kind, cur.number("Q", f"tensor {name}'s offset")))
    return tensors, alignment


def _check_tensors(where: str, tensors: list, data_start: int, alignment: int, file_bytes: int) -> None:
    """Each tensor's type known, its bytes aligned and inside the file, no two tensors' bytes shared."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415 - deferred: the `realmodel` extra

    spans = []
    for name, shape, kind, offset in tensors:
        try:
            qtype = GGMLQuantizationType(kind)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GgufError(f"{where}: tensor {name} has type {kind}, which the gguf package does not know") from None
        if shape and shape[0] % block:
            raise GgufError(f"{where}: tensor {name} ({qtype.name}) has an innermost dimension of {shape[0]}, not a "
                            f"whole number of its {block}-value blocks")
        elements = 1
        for size in shape:
            elements *= size
        start, end = data_start + offset, data_start + offset + elements // block * block_bytes
        if offset % alignment or end > file_bytes:
            raise GgufError(f"{where}: tensor {name}'s {end - start} bytes at offset {start} are "
                            + (f"not aligned to {alignment} bytes" if offset % alignment else
                               f"past the end of the file ({file_bytes} bytes): the file is cut short or damaged"))
        spans.append((start, end, name))
    spans.sort()
    for (_, end, name), (start, _, later) in zip(spans, spans[1:]):
        if start < end:
            raise GgufError(f"{where}: tensors {name} and {later} share bytes from offset {start} (a damaged header)")


__all__ = ["check_layout"]
