"""GGUF reading: our header parser against the gguf package's reader, and every bad-file error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from potluck.errors import ModelFileError, UnsupportedError
from potluck.model.archs import hparams_from_metadata
from potluck.modelfile.gguf_file import GGUFFile


def test_header_matches_gguf_reader(smollm2_path: Path) -> None:
    ours = GGUFFile(smollm2_path)
    ref = gguf.GGUFReader(smollm2_path)
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.nbytes == t.n_bytes
        assert np.array_equal(
            ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key


def test_hparams_of_both_real_models(smollm2_path: Path, gemma3_path: Path) -> None:
    smol = hparams_from_metadata(GGUFFile(smollm2_path).metadata)
    assert (smol.arch, smol.n_layer, smol.n_embd, smol.n_head, smol.n_head_kv) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert smol.rules.rope_style == "norm" and not smol.is_sliding(0)
    gem = hparams_from_metadata(GGUFFile(gemma3_path).metadata)
    assert (gem.arch, gem.n_layer, gem.head_dim, gem.n_head_kv, gem.sliding_window) == (
        "gemma3",
        18,
        256,
        1,
        512,
    )
    # every 6th layer is global (5, 11, 17) with the long RoPE base, the others slide with 10 000
    assert [i for i in range(18) if not gem.is_sliding(i)] == [5, 11, 17]
    assert gem.rope_base_for(0) == 10_000.0 and gem.rope_base_for(5) == 1_000_000.0


def test_foreign_file(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelFileError, match=r"not a GGUF file \(starts with b'PK"):
        GGUFFile(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_truncated_data(tmp_path: Path, smollm2_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    data = smollm2_path.read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        ModelFileError, match=r"truncated: tensors need [\d,]+ bytes .* \(1,000 missing\)"
    ):
        GGUFFile(p)


def test_truncated_header(tmp_path: Path, smollm2_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    p.write_bytes(smollm2_path.read_bytes()[:5000])  # ends inside the vocabulary array
    with pytest.raises(ModelFileError, match="header is corrupt or truncated"):
        GGUFFile(p)


def test_corrupt_count(tmp_path: Path, smollm2_path: Path) -> None:
    data = bytearray(smollm2_path.read_bytes()[:4096])
    data[8:16] = (2**62).to_bytes(8, "little")  # tensor count
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="implausible count"):
        GGUFFile(p)


def test_unknown_architecture(smollm2_path: Path) -> None:
    meta = dict(GGUFFile(smollm2_path).metadata, **{"general.architecture": "mamba"})
    with pytest.raises(
        UnsupportedError,
        match=r"architecture 'mamba' is not supported; supported: .*gemma3, .*llama",
    ):
        hparams_from_metadata(meta, "m.gguf")


def test_missing_key(smollm2_path: Path) -> None:
    meta = dict(GGUFFile(smollm2_path).metadata)
    del meta["llama.block_count"]
    with pytest.raises(ModelFileError, match="metadata key llama.block_count is missing"):
        hparams_from_metadata(meta, "x.gguf")


def test_newer_gguf_version_is_unsupported_not_corrupt(tmp_path: Path, smollm2_path: Path) -> None:
    """A sound file in a GGUF version this reader does not know: not "re-download the file"."""
    data = bytearray(smollm2_path.read_bytes()[:4096])
    data[4:8] = (99).to_bytes(4, "little")
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match="GGUF version 99 is not supported") as err:
        GGUFFile(p)
    assert "re-download" not in str(err.value) and "newer Potluck" in str(err.value)
