"""Which build of ggml computes (model/ggml_lib.py: the one Potluck's install built by default,
POTLUCK_GGML for another): clear errors for a build that is not there, and another build computing
what the default one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_BIN = Path(
    os.environ.get(
        "LLAMA_CPP_BIN", "/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
    )
)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("/nonexistent/ggml", "POTLUCK_GGML=/nonexistent/ggml: no libggml.so in /nonexistent/ggml"),
        ("llama-cpp-python", "llama-cpp-python is not installed"),
    ],
)
def test_a_missing_ggml_build_is_one_line(where: str, said: str) -> None:
    import importlib.util

    if where == "llama-cpp-python" and importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    done = _cli("doctor", env={"POTLUCK_GGML": where})
    assert done.returncode == 1
    assert said in done.stderr and "Traceback" not in done.stderr


def test_the_startup_line_names_the_ggml_build() -> None:
    from potluck.model.ggml_lib import BUILT, describe, version

    if os.environ.get("POTLUCK_GGML"):
        pytest.skip("POTLUCK_GGML names another build")
    # the install's own build: llama.cpp's ggml, with its tinyBLAS prompt kernels
    assert (BUILT / "libggml.so").is_file()
    assert version() == "0.25.3 (potluck)" and describe().startswith(f"ggml {version()}: ")
    assert "LLAMAFILE" in describe()


_LOGITS = """
import json, sys
import numpy as np
from potluck.model import ggml_lib
if sys.argv[2]:
    ggml_lib.use_library(sys.argv[2])
from potluck.pool.build import load_model
from potluck.model.stage import SeqChunk
m = load_model(sys.argv[1], n_ctx=64)
ids = np.array(m.tokenizer.encode("The capital of France is"))
out = m.pipeline.forward(ids, [SeqChunk(0, len(ids))], logits_rows=list(range(len(ids))))
print(json.dumps({"version": ggml_lib.version(), "logits": out[:, :512].tolist(),
                  "argmax": out.argmax(-1).tolist()}))
"""


def test_llama_cpps_own_build_computes_what_potlucks_does(smollm2_path: Path) -> None:
    """The same prompt's logits through the ggml Potluck's install built and through llama.cpp's
    own build of the same ggml (other compile flags, so equal only within a tolerance). Skips
    where no llama.cpp build is on this machine (bench/README.md says how to build one;
    LLAMA_CPP_BIN names it)."""
    if not (LLAMA_BIN / "libggml.so").is_file():
        pytest.skip(f"no llama.cpp build of ggml in {LLAMA_BIN} (LLAMA_CPP_BIN)")
    import numpy as np

    runs = []
    for where in ("", str(LLAMA_BIN)):
        done = subprocess.run(
            [sys.executable, "-c", _LOGITS, str(smollm2_path), where],
            env={k: v for k, v in os.environ.items() if k != "POTLUCK_GGML"},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    default, other = runs
    assert default["version"] != other["version"]
    assert str(LLAMA_BIN) in other["version"]
    a, b = np.array(default["logits"]), np.array(other["logits"])
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert default["argmax"] == other["argmax"]
