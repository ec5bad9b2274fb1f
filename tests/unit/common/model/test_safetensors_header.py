"""A safetensors file whose header is malformed (a damaged or hand-made checkpoint) is refused as a CheckpointError
naming the file and the tensor, never loaded from the wrong bytes or failed with a bare AttributeError/KeyError."""

import json
import struct

import numpy as np
import pytest

from grpo_stream.common.model.hf_checkpoint import CheckpointError, read_safetensors, write_safetensors


def _file(tmp_path, header, body=b"\0" * 16):
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return path


@pytest.mark.parametrize("header, message", [
    ([1, 2], "header is not a JSON object of tensors"),
    ({"w": 3}, "tensor w: header entry 3 lacks dtype, shape or data_offsets"),
    ({"w": {"dtype": "F32", "shape": [2]}}, "tensor w: header entry .* lacks dtype, shape or data_offsets"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, "tensor w has dtype"),
    ({"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, "tensor w has shape \\[-1, -2\\]"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": 8}}, "data_offsets 8; both must list"),
    # a negative start passed the length check and read the header's own bytes as the tensor
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "data_offsets \\[-8, 0\\]; both must list"),
    ({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "runs past the end of the file"),
])
def test_malformed_headers_name_the_file_and_tensor(tmp_path, header, message):
    path = _file(tmp_path, header)
    with pytest.raises(CheckpointError, match=f"{path}: .*{message}|{path}: {message}"):
        list(read_safetensors(path))


def test_a_well_formed_file_still_reads(tmp_path):
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    got = dict(read_safetensors(path))
    np.testing.assert_array_equal(got["w"], np.arange(6).reshape(2, 3))
