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


def test_a_node_names_the_model_files_whose_hash_it_knows(tmp_path: Path) -> None:
    """LocalModels.known lists the sha256 of files it has hashed before (reading none); the
    worker hashes its --model-dir in the background so that its Hello names them; a file changed
    since it was hashed is not named until hashed again, and find() finds it by size and hash."""
    import hashlib
    import os

    from potluck.node.weights import LocalModels

    folder = tmp_path / "models"
    folder.mkdir()
    data = os.urandom(3000)
    (folder / "m.gguf").write_bytes(data)
    (folder / "notes.txt").write_bytes(b"not a model")
    places = Places.of({"POTLUCK_CACHE": str(tmp_path / "cache")}, tmp_path)
    models = LocalModels(places, (folder,))
    assert models.known() == []  # never hashed: nothing is read to answer
    models.hash_extra_dirs()
    digest = hashlib.sha256(data).hexdigest()
    assert models.known() == [digest]
    assert LocalModels(places, (folder,)).known() == [digest]  # remembered on disk
    assert LocalModels(places).known() == []  # a folder it was not given is not looked in
    assert models.find(digest, len(data)) == folder / "m.gguf"
    assert models.find(digest, len(data) + 1) is None
    changed = os.urandom(3000)
    (folder / "m.gguf").write_bytes(changed)
    os.utime(folder / "m.gguf", ns=(1, 1))  # (a new mtime, whatever the clock's resolution)
    assert models.known() == []
    assert models.find(digest, len(data)) is None
    assert models.known() == [hashlib.sha256(changed).hexdigest()]  # find() hashed it
