"""Which GGUF tensors a stage of layers [start, stop) needs (no ggml: the head uses it to ship
weights, the planner to size stages)."""

from __future__ import annotations

from collections.abc import Iterable

from potluck.modelfile.gguf_file import TensorInfo


def stage_tensor_names(
    tensors: Iterable[TensorInfo], n_layer: int, start: int, stop: int
) -> list[str]:
    """Tensors of blocks [start, stop), plus token_embd for the first stage, and output_norm and the
    head for the last (token_embd again when the head is tied to it)."""
    infos = list(tensors)
    names = {t.name for t in infos}
    need = [t.name for t in infos if t.layer is not None and start <= t.layer < stop]
    if start == 0:
        need.append("token_embd.weight")
    if stop == n_layer:
        need.append("output_norm.weight")
        need.append("output.weight" if "output.weight" in names else "token_embd.weight")
    # RoPE's frequency factors, which every layer reads (Llama 3.1's; LongRoPE's, phi3)
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if name in names:
            need.append(name)
    return list(dict.fromkeys(need))
