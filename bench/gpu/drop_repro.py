"""A stage with layers on the GPU: prompt sequence A, drop it, then decode a new sequence B from
an empty cache (what bench_single.py's warm-up does). On Vulkan (Mesa's lavapipe) the first
decode of B segfaulted inside libvulkan_lvp.so (a 4-layer tiny model at -ngl 2/4/99, SmolLM2 at
-ngl 2/5/10/99) until model/stage.py restarted ggml's Vulkan backend after a KV buffer on the
device is freed (tests/test_gpu.py covers it). Kept to try the same on CUDA, where no restart is
made (bench/gpu/run.sh runs it there).

    python bench/gpu/drop_repro.py [MODEL.gguf] [NGL]     # no model: a tiny llama from tests/ggufgen.py
Prints "ok" per step; a crash ends the process (exit 139)."""

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tests"))
from potluck.cli.runtime import compute_of  # noqa: E402
from potluck.engine.generate import load_model  # noqa: E402
from potluck.model.stage import SeqChunk  # noqa: E402

path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "tiny" else None
ngl = int(sys.argv[2]) if len(sys.argv) > 2 else 99
if path is None:
    from gguf import GGMLQuantizationType as T

    from ggufgen import write_tiny_model

    path = str(
        write_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny.gguf",
            "llama",
            None,
            T.Q8_0,
            n_layer=4,
            n_embd=576,
            n_head=9,
            n_head_kv=3,
            n_ff=1536,
        )
    )
model = load_model(path, n_ctx=256, compute=compute_of(2, n_gpu_layers=ngl))
pipe, ids = model.pipeline, np.arange(5, 45, dtype=np.int64)
print("device:", pipe.stages[0].gpu_device, flush=True)
a = model.new_seq_id()
pipe.forward(ids[:8], [SeqChunk(a, 8)])
print("ok: prompt of A", flush=True)
pipe.drop(a)
print("ok: drop A", flush=True)
b = model.new_seq_id()
for i in range(4):
    pipe.forward(ids[i : i + 1], [SeqChunk(b, 1)])
    print(f"ok: decode step {i} of B", flush=True)
print("ok: all")
