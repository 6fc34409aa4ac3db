"""Where models are looked for (modelfile/sources.Places), from an environment given as a mapping:
the CLI passes os.environ; nothing else reads it."""

from __future__ import annotations

from pathlib import Path

from potluck.modelfile.sources import Places, search_roots

HOME = Path("/home/ann")


def test_the_defaults_are_under_home() -> None:
    p = Places.of({}, HOME)
    assert p.cache == HOME / ".cache" / "potluck"
    assert p.ollama == HOME / ".ollama" / "models"
    assert p.huggingface == HOME / ".cache" / "huggingface" / "hub"


def test_each_variable_as_its_app_reads_it() -> None:
    env = {"XDG_CACHE_HOME": "/x", "OLLAMA_MODELS": "/o"}
    p = Places.of(env, HOME)
    assert p.cache == Path("/x/potluck") and p.huggingface == Path("/x/huggingface/hub")
    assert p.ollama == Path("/o")
    assert Places.of({**env, "POTLUCK_CACHE": "/p"}, HOME).cache == Path("/p")
    assert Places.of({"HF_HOME": "/hf"}, HOME).huggingface == Path("/hf/hub")
    # the hub folder itself, whatever its name
    assert Places.of({"HF_HOME": "/hf", "HF_HUB_CACHE": "/models"}, HOME).huggingface == Path(
        "/models"
    )


def test_the_search_covers_potluck_ollama_lm_studio_and_hugging_face() -> None:
    roots = search_roots(Places.of({"POTLUCK_CACHE": "/p"}, HOME))
    assert roots[0] == (Path("/p/models"), "potluck")
    assert {source for _, source in roots} == {"potluck", "ollama", "lmstudio", "huggingface"}
