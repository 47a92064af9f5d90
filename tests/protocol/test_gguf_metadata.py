"""protocol/gguf_metadata.py against the ``gguf`` library's own reader: the same ``{key: value}`` for a
file with a value of every GGUF type, tensors after the metadata; clear errors for what is not one.
(The real SmolLM2 file goes through it in tests/worker_model/test_gguf.py: the fleet's and the sim
engine's tokenizer ids equal the worker's.)"""
from __future__ import annotations

import numpy as np
import pytest

from protocol.gguf_metadata import gguf_metadata

gguf = pytest.importorskip("gguf")


def _write(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 0.1)           # not exact in float32: both readers give the same double
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.yes", True)
    w.add_bool("t.no", False)
    w.add_string("t.str", "naïve café — 東京 🚀")
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["a", "", "Ġthe", "<|im_end|>", "ü"])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.none", [])
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_same_values_as_the_gguf_reader(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    ref = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    got = gguf_metadata(path)
    assert got == ref
    assert [type(v) for v in got.values()] == [type(v) for v in ref.values()]
    assert got["t.str"] == "naïve café — 東京 🚀" and got["t.u64"] == 2**64 - 1 and got["t.yes"] is True
    assert got["GGUF.tensor_count"] == 1 and got["general.architecture"] == "llama"


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match=r"expected magic b'GGUF', found b'GGML'"):
        gguf_metadata(bad)
    bad.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match=r"GGUF version 1 .*expected 2 or 3"):
        gguf_metadata(bad)
    for cut in (60, data.index("Ġthe".encode()) + 2):   # in a count; in a string's bytes
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"GGUF metadata ends early"):
            gguf_metadata(bad)
