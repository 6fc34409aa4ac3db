"""This process's settings, made once before anything loads: how it computes — CPU threads (-t),
the KV cache type and weight repacking, the GPU (-ngl, --device, --vram) — as one `Compute`, and
where it keeps models (`Places`, from the environment); the command hands both to what it builds.
And the line that names the ggml build's devices."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from potluck.model.stage import Compute
    from potluck.modelfile.sources import Places


def places() -> Places:
    """Where this machine keeps models: $POTLUCK_CACHE (else $XDG_CACHE_HOME/potluck, else
    ~/.cache/potluck), and the Ollama, LM Studio and Hugging Face folders ($OLLAMA_MODELS,
    $HF_HUB_CACHE, $HF_HOME). The only place that reads these variables."""
    from potluck.modelfile.sources import Places

    return Places.of(os.environ, Path.home())


def compute_of(
    threads: int | None = None,
    cache_type: str = "f16",
    no_repack: bool = False,
    n_gpu_layers: int = 0,
    device: str | None = None,
    vram: int | None = None,
    n_cpu_moe: int = 0,
) -> Compute:
    """The settings from the flags: threads default to the physical cores; stages put their last
    n_gpu_layers layers on `device` (at most `vram` bytes there), checked now, so that a machine
    without that GPU says so before any load. POTLUCK_GPU_BYTES_PER_S gives the GPU's speed
    instead of measuring it: for tests on a software GPU (Mesa's lavapipe), whose speed is not a
    GPU's. n_cpu_moe: the first that many layers keep their routed experts in RAM (--cpu-moe,
    --n-cpu-moe)."""
    from potluck.model.stage import Compute, GpuConfig
    from potluck.node.probe import physical_cores

    if device is not None and device.lower() == "cpu":
        n_gpu_layers, device = 0, None
    if n_gpu_layers:
        from potluck.model.ggml_lib import BackendError, device_advice, gpu_device

        try:
            gpu_device(device)  # BackendError (one line) when this machine's ggml has no such GPU
        except BackendError:  # a GPU backend built in that found no device: say why
            if device is None and (advice := device_advice(os.environ)) is not None:
                raise BackendError(
                    f"-ngl {n_gpu_layers}: this machine has no GPU: {advice}"
                ) from None
            raise
    elif device is not None:
        raise typer.BadParameter(f"--device {device} needs -ngl N (how many layers go there)")
    elif n_cpu_moe:
        raise typer.BadParameter(
            "--cpu-moe / --n-cpu-moe keep experts in RAM beside layers on the GPU: give -ngl N too"
        )
    speed = os.environ.get("POTLUCK_GPU_BYTES_PER_S")
    gpu = GpuConfig(n_gpu_layers, device, vram, float(speed) if speed else None, n_cpu_moe)
    try:
        return Compute(threads or physical_cores(), cache_type, not no_repack, gpu)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _backends() -> str:
    """One line: the devices and CPU features of this machine's ggml."""
    from potluck.model.ggml_lib import build_advice, describe

    advice = build_advice()
    return describe() + (f"\n[yellow]note:[/] {advice}" if advice else "")


def _backends_check() -> tuple[str, str | None]:
    """doctor's `backend` check: the devices line, and what to do about a build that lacks a
    kernel or a GPU backend that finds no device (None: nothing)."""
    from potluck.model.ggml_lib import build_advice, describe, device_advice

    advice = [a for a in (device_advice(os.environ), build_advice()) if a]
    return describe(), "; ".join(advice) or None
