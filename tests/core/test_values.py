"""The safe encoding of non-tensor values: round trips, refusals and hostile records."""

from __future__ import annotations

import json
import pathlib
import random

import numpy as np
import pytest
import torch

from bcp.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from bcp.layout.values import decode_value, encode_value


def roundtrip(value, **kwargs):
    encoded = encode_value(value, key="k", **kwargs)
    record = memoryview(b"".join(encoded.chunks()))
    return decode_value(record, len(encoded.tree), key="k", path="p", **kwargs)


def test_round_trip_of_every_allowed_type():
    value = {
        "none": None, "bool": True, "int": 2**70, "float": 0.1, "nan": float("nan"), "inf": float("-inf"),
        "str": "é", "list": [1, [2]], "tuple": (1, (2, 3)), "set": {1, 2}, "frozenset": frozenset({"a"}),
        "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"), "complex": 1 + 2j,
        "tensor": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.empty(0, 3),
        "bool_tensor": torch.tensor([True, False]), "scalar": torch.tensor(3, dtype=torch.int64),
        "view": torch.arange(12.0).reshape(3, 4)[:, 1], "ndarray": np.arange(5, dtype=np.int16),
        "npscalar": np.float32(1.5), "dtype": torch.float16, "device": torch.device("cpu"),
        "size": torch.Size([2, 3]), "path": pathlib.Path("/tmp/x"), (1, 2): "tuple key", 3: "int key",
        "rng": torch.get_rng_state(), "np_rng": np.random.get_state(), "py_rng": random.getstate(),
    }
    out = roundtrip(value)
    assert out.keys() == value.keys()
    for key, expected in value.items():
        got = out[key]
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
        elif key == "np_rng":
            assert got[0] == expected[0] and np.array_equal(got[1], expected[1]) and got[2:] == expected[2:]
        elif isinstance(expected, np.ndarray):
            assert np.array_equal(got, expected) and got.dtype == expected.dtype
        elif key == "nan":
            assert got != got
        else:
            assert got == expected and type(got) is type(expected), key
    random.setstate(out["py_rng"])  # the restored states are usable as such
    np.random.set_state(out["np_rng"])
    torch.set_rng_state(out["rng"])


def test_unsupported_type_names_key_and_type():
    class Custom:
        pass

    with pytest.raises(UnsupportedValueError, match=r"Custom.*'k.a\[1\]'"):
        encode_value({"a": [1, Custom()]}, key="k")


def test_pickle_is_opt_in_on_both_sides():
    value = {"obj": pathlib.PurePosixPath("x").__class__}  # a class: not in the safe set
    encoded = encode_value(value, key="k", allow_pickle=True)
    assert encoded.used_pickle
    record = memoryview(b"".join(encoded.chunks()))
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        decode_value(record, len(encoded.tree), key="k", path="p")
    assert decode_value(record, len(encoded.tree), key="k", path="p", allow_pickle=True) == value


@pytest.mark.parametrize("tree", [
    b"not json", b'{"$eval": "1"}', b'{"$tensor": {"dtype": "float32", "shape": [4], "at": [0, 999]}}',
    b'{"$tensor": {"dtype": "os.system", "shape": [1], "at": [0, 4]}}',
    b'{"$ndarray": {"dtype": "O", "shape": [1], "at": [0, 8]}}', b'{"$float": "1e999"}',
    b'{"$dict": [[1]]}', b'{"a": 1, "b": 2}',
])
def test_hostile_records_are_refused(tree):
    record = memoryview(tree + b"\x00" * 8)
    with pytest.raises(CorruptCheckpointError):
        decode_value(record, len(tree), key="k", path="p")


def test_tree_is_json():
    encoded = encode_value({"a": (1, 2)}, key="k")
    assert json.loads(encoded.tree) == {"$dict": [["a", {"$tuple": [1, 2]}]]}
