"""`potluck doctor` (and -ngl's error) say why a GPU backend ggml was built with found no device:
no Vulkan driver at all, only Mesa's software device (hidden unless GGML_VK_VISIBLE_DEVICES), or
drivers that see no GPU. The registries and the driver folders are given here; tests/test_gpu.py
checks the real Vulkan build's answer."""

from __future__ import annotations

from pathlib import Path

from potluck.model.ggml_lib import device_advice


def _icds(tmp_path: Path, *names: str) -> list[str]:
    d = tmp_path / "icd.d"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_text("{}")
    return [str(d), str(tmp_path / "absent")]


def test_nothing_to_say_when_every_backend_found_a_device(tmp_path: Path) -> None:
    assert device_advice({}, {"CPU": 1}, _icds(tmp_path)) is None
    assert device_advice({}, {"CPU": 1, "Vulkan": 1}, _icds(tmp_path)) is None


def test_no_vulkan_driver(tmp_path: Path) -> None:
    said = device_advice({}, {"CPU": 1, "Vulkan": 0}, _icds(tmp_path))
    assert said is not None and "no Vulkan driver" in said and "mesa-vulkan-drivers" in said


def test_only_lavapipe_hidden_and_named(tmp_path: Path) -> None:
    icds = _icds(tmp_path, "lvp_icd.x86_64.json")
    said = device_advice({}, {"CPU": 1, "Vulkan": 0}, icds)
    assert said is not None and "lavapipe" in said and "GGML_VK_VISIBLE_DEVICES=0" in said
    said = device_advice({"GGML_VK_VISIBLE_DEVICES": "3"}, {"CPU": 1, "Vulkan": 0}, icds)
    assert said is not None and "lavapipe" in said and "GGML_VK_VISIBLE_DEVICES=0" not in said


def test_drivers_that_see_no_gpu(tmp_path: Path) -> None:
    icds = _icds(tmp_path, "lvp_icd.x86_64.json", "radeon_icd.x86_64.json")
    said = device_advice({}, {"CPU": 1, "Vulkan": 0}, icds)
    assert said is not None and "radeon_icd.x86_64.json" in said and "vulkaninfo" in said
    assert "GGML_VK_VISIBLE_DEVICES=0" in said  # lavapipe is among them, hidden
    # drivers named by the loader's own variable are the ones it uses
    said = device_advice({"VK_ICD_FILENAMES": "/x/lvp_icd.json"}, {"CPU": 1, "Vulkan": 0}, icds)
    assert said is not None and "lavapipe" in said


def test_other_backends(tmp_path: Path) -> None:
    said = device_advice({}, {"CPU": 1, "CUDA": 0}, _icds(tmp_path))
    assert said is not None and "built with CUDA" in said and "nvidia-smi" in said
