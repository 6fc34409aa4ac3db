"""LoRA adapters as GGUF files, in llama.cpp's format.

An adapter file holds, for each adapted matrix `W` of the base model (GGUF name, e.g.
`blk.3.attn_q.weight`, logical shape (n_out, n_in)), two tensors:

    <name>.lora_a   (r, n_in)     ggml ne = [n_in, r]
    <name>.lora_b   (n_out, r)    ggml ne = [r, n_out]

and the metadata `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`,
`general.architecture` (the base model's). Applied without merging: W x + s · B (A x), where
s = scale · alpha / r (scale: the user's, default 1; alpha 0 means s = scale), as llama.cpp does,
and as PEFT's LoRA with `lora_alpha = alpha` computes it (A = lora_A.weight, B = lora_B.weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFType, GGUFWriter, Keys

from potluck.errors import ModelFileError
from potluck.modelfile.gguf_file import GGUFFile, TensorInfo

SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"
_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class LoraPair:
    base: str  # the base model's tensor, e.g. "blk.3.attn_q.weight"
    rank: int

    @property
    def a(self) -> str:
        return self.base + SUFFIX_A

    @property
    def b(self) -> str:
        return self.base + SUFFIX_B


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter file checked against a base model; `scale` is the user's (`--lora F:SCALE`)."""

    path: Path
    file: GGUFFile
    alpha: float
    scale: float
    pairs: Mapping[str, LoraPair]  # by base tensor name

    @property
    def name(self) -> str:
        return self.path.stem

    def factor(self, base: str) -> float:
        """s in W x + s · B (A x) for that base tensor."""
        pair = self.pairs[base]
        return self.scale * self.alpha / pair.rank if self.alpha else self.scale


def parse_lora_arg(arg: str) -> tuple[Path, float]:
    """'PATH' or 'PATH:SCALE' (a path may itself hold ':'; the part after the last one is the
    scale only if it is a number)."""
    head, sep, tail = arg.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(arg), 1.0


def open_lora(
    path: str | Path, arch: str, base: Mapping[str, TensorInfo], scale: float = 1.0
) -> LoraAdapter:
    """Open an adapter and check it fits the base model (architecture, names, shapes, types);
    ModelFileError with the numbers where it does not."""
    f = GGUFFile(path)
    meta = f.metadata
    where = str(f.path)
    if meta.get(Keys.General.TYPE) != GGUFType.ADAPTER or meta.get(Keys.Adapter.TYPE) != "lora":
        raise ModelFileError(
            f"{where} is not a LoRA adapter (general.type={meta.get(Keys.General.TYPE)!r}, "
            f"adapter.type={meta.get(Keys.Adapter.TYPE)!r}; expected 'adapter' and 'lora'): "
            "pass a model with -m, an adapter with --lora"
        )
    if f.arch != arch:
        raise ModelFileError(
            f"{where} adapts a {f.arch} model, but the model is {arch}: use an adapter trained "
            "on this model"
        )
    alpha = float(meta.get(Keys.Adapter.LORA_ALPHA, 0.0))
    pairs: dict[str, LoraPair] = {}
    for name in f.tensors:
        if name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B):
            pairs.setdefault(name[: -len(SUFFIX_A)], LoraPair(name[: -len(SUFFIX_A)], 0))
        else:
            raise ModelFileError(f"{where}: tensor {name} is neither a .lora_a nor a .lora_b")
    if not pairs:
        raise ModelFileError(f"{where} holds no LoRA tensors")
    for name in list(pairs):
        pairs[name] = _check_pair(f, where, name, base)
    return LoraAdapter(f.path, f, alpha, scale, pairs)


def _check_pair(f: GGUFFile, where: str, name: str, base: Mapping[str, TensorInfo]) -> LoraPair:
    a, b = f.tensors.get(name + SUFFIX_A), f.tensors.get(name + SUFFIX_B)
    if a is None or b is None:
        half = SUFFIX_B if a is None else SUFFIX_A
        raise ModelFileError(f"{where}: tensor {name}{half} is missing (its pair is there)")
    w = base.get(name)
    if w is None or len(w.shape) != 2:
        raise ModelFileError(f"{where}: adapts {name}, which the model has no matrix of that name")
    for t in (a, b):
        if t.qtype not in _TYPES:
            raise ModelFileError(
                f"{where}: tensor {t.name} is {t.qtype.name}; adapters are F32, F16 or BF16"
            )
    n_out, n_in = w.shape
    rank = a.shape[0]
    if a.shape != (rank, n_in) or b.shape != (n_out, rank):
        raise ModelFileError(
            f"{where}: {name} is {n_out}×{n_in}, so lora_a must be {rank}×{n_in} and lora_b "
            f"{n_out}×{rank}; they are {a.shape[0]}×{a.shape[1]} and {b.shape[0]}×{b.shape[1]}"
        )
    return LoraPair(name, rank)


def adapter_part(adapter: LoraAdapter, names: set[str], path: str | Path) -> int:
    """Write to `path` the adapter cut to the base tensors in `names` (a stage's): the same
    metadata, the pairs of those tensors as they are in the file. How many pairs it holds."""
    f = adapter.file
    w = GGUFWriter(str(path), f.arch)
    w.add_type(GGUFType.ADAPTER)
    w.add_string(Keys.Adapter.TYPE, "lora")
    w.add_float32(Keys.Adapter.LORA_ALPHA, adapter.alpha)
    pairs = [p for base, p in adapter.pairs.items() if base in names]
    for p in pairs:
        for t in (p.a, p.b):
            info = f.tensors[t]
            raw = np.asarray(f.raw(t))
            w.add_tensor(t, raw, raw_shape=raw.shape, raw_dtype=info.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(pairs)


def write_lora(
    path: str | Path,
    arch: str,
    alpha: float,
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
    dtype: type = np.float32,
) -> None:
    """Write an adapter: pairs[base name] = (A (r, n_in), B (n_out, r)), as `dtype` (f32/f16)."""
    w = GGUFWriter(str(path), arch)
    w.add_type(GGUFType.ADAPTER)
    w.add_string(Keys.Adapter.TYPE, "lora")
    w.add_float32(Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, (a, b) in pairs.items():
        w.add_tensor(name + SUFFIX_A, np.ascontiguousarray(a, dtype))
        w.add_tensor(name + SUFFIX_B, np.ascontiguousarray(b, dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
