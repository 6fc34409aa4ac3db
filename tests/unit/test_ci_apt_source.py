""".ci/apt_source.py: CI's newer apt suite is the machine's own Debian source with another suite
(same URIs, same keyring), so no registry address is written into the project."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

OS_RELEASE = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nVERSION_CODENAME=bookworm\n'


def _module() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / ".ci" / "apt_source.py"
    spec = importlib.util.spec_from_file_location("apt_source", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_deb822_source_is_copied_with_the_new_suite(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\n# a snapshot comment\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\nSigned-By: /k/sec.gpg\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main contrib\nSigned-By: /k/archive.gpg\n"
    )
    got = _module().source_for("trixie", tmp_path, OS_RELEASE)
    assert got == (
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: trixie\nComponents: main\n"
        "Signed-By: /k/archive.gpg\n"
    )


def test_one_line_source_is_copied_with_the_new_suite(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k/a.gpg] http://proxy.lan:3142/debian bookworm main\n"
    )
    got = _module().source_for("trixie", tmp_path, OS_RELEASE)
    assert "URIs: http://proxy.lan:3142/debian\nSuites: trixie\n" in got
    assert got.endswith("Signed-By: /k/a.gpg\n")


def test_no_source_for_this_release_is_said(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian bullseye main\n")
    with pytest.raises(SystemExit, match="no configured apt source serves bookworm main"):
        _module().source_for("trixie", tmp_path, OS_RELEASE)
