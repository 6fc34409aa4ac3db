"""ggml through ctypes: the library Potluck's install builds, with our own declarations.

`pip install` builds ggml from source with CMake (CMakeLists.txt at the repository's root;
`CMAKE_ARGS` picks GPU backends, as for llama-cpp-python) into `potluck/_ggml`: the ggml that
llama.cpp 0c1e570 vendors (0.25.3), from the llama-cpp-python 0.3.36 source package, so every
machine runs llama.cpp's own kernels (its tiled K-quant prompt matmuls, its repacked layouts).
This module declares every function Potluck calls, pointers as `c_void_p`, and loads the libraries.
Everything else in Potluck calls ggml through `lib` below.

`use_library` swaps in another build of ggml before the first call (cli/__init__.py: `POTLUCK_GGML`): a
folder with `libggml.so` (`libggml.dylib` on macOS, `ggml.dll` on Windows: `GGML_FILE`; a llama.cpp
build folder, a ggml built with other flags), or the one `llama-cpp-python` installs. Every
declaration below was checked equal in the headers of ggml 0.15.3 (the older ggml that
ggml-python 0.0.45 vendors; its build works too) and 0.25.3, as is `struct ggml_tensor`.

Tensors, contexts, graphs, backends and buffers are plain ints (addresses) here. `lib`'s
functions are ctypes' and untyped (Any): a caller names the type of what it keeps,
`x: int = lib.ggml_add(ctx, a, b)`, or `int | None` where it tests for NULL (ctypes gives None).

Mostly a table of ctypes declarations, one per ggml function Potluck calls; over 400 lines on
purpose: one place to check them against ggml's headers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from ctypes import POINTER, c_bool, c_char_p, c_float, c_int, c_int64, c_size_t, c_uint8, c_void_p
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from potluck.errors import PotluckError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class BackendError(PotluckError):
    """ggml is missing, or a backend (device) could not be started or ran out of memory."""


P = c_void_p

# name: (argument types, return type); None = void
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    # contexts, tensors, graphs
    "ggml_init": ([], P),  # argtypes set below (a struct by value)
    "ggml_version": ([], c_char_p),
    "ggml_free": ([P], None),
    "ggml_log_set": ([P, P], None),
    "ggml_tensor_overhead": ([], c_size_t),
    "ggml_graph_overhead_custom": ([c_size_t, c_bool], c_size_t),
    "ggml_new_tensor_1d": ([P, c_int, c_int64], P),
    "ggml_new_tensor_2d": ([P, c_int, c_int64, c_int64], P),
    "ggml_new_tensor_3d": ([P, c_int, c_int64, c_int64, c_int64], P),
    "ggml_new_tensor_4d": ([P, c_int, c_int64, c_int64, c_int64, c_int64], P),
    "ggml_set_name": ([P, c_char_p], P),
    "ggml_set_input": ([P], None),
    "ggml_set_output": ([P], None),
    "ggml_nbytes": ([P], c_size_t),
    "ggml_row_size": ([c_int, c_int64], c_size_t),
    "ggml_blck_size": ([c_int], c_int64),
    "ggml_type_size": ([c_int], c_size_t),
    "ggml_new_graph_custom": ([P, c_size_t, c_bool], P),
    "ggml_build_forward_expand": ([P, P], None),
    "ggml_graph_n_nodes": ([P], c_int),
    # operations
    "ggml_get_rows": ([P, P, P], P),
    "ggml_set_rows": ([P, P, P, P], P),
    "ggml_mul_mat": ([P, P, P], P),
    "ggml_add": ([P, P, P], P),
    "ggml_add_id": ([P, P, P, P], P),
    "ggml_mul": ([P, P, P], P),
    "ggml_div": ([P, P, P], P),
    "ggml_mul_mat_id": ([P, P, P, P], P),
    "ggml_soft_max": ([P, P], P),
    "ggml_sigmoid": ([P, P], P),
    "ggml_tanh": ([P, P], P),
    "ggml_argsort_top_k": ([P, P, c_int], P),
    "ggml_sum_rows": ([P, P], P),
    "ggml_clamp": ([P, P, c_float, c_float], P),
    "ggml_scale": ([P, P, c_float], P),
    "ggml_scale_bias": ([P, P, c_float, c_float], P),
    "ggml_rms_norm": ([P, P, c_float], P),
    "ggml_rope_ext": (
        [P, P, P, P, c_int, c_int, c_int, c_float, c_float, c_float, c_float, c_float, c_float],
        P,
    ),
    "ggml_rope_multi": (
        [
            P,
            P,
            P,
            P,
            c_int,
            POINTER(c_int),
            c_int,
            c_int,
            c_float,
            c_float,
            c_float,
            c_float,
            c_float,
            c_float,
        ],
        P,
    ),  # fmt: skip
    "ggml_ssm_conv": ([P, P, P], P),
    "ggml_gated_delta_net": ([P, P, P, P, P, P, P, c_int64], P),
    "ggml_softplus": ([P, P], P),
    "ggml_silu": ([P, P], P),
    "ggml_transpose": ([P, P], P),
    "ggml_repeat_4d": ([P, P, c_int64, c_int64, c_int64, c_int64], P),
    "ggml_view_4d": (
        [P, P, c_int64, c_int64, c_int64, c_int64, c_size_t, c_size_t, c_size_t, c_size_t],
        P,
    ),
    "ggml_flash_attn_ext": ([P, P, P, P, P, c_float, c_float, c_float], P),
    "ggml_flash_attn_ext_set_prec": ([P, c_int], None),
    "ggml_flash_attn_ext_add_sinks": ([P, P], None),
    "ggml_swiglu_split": ([P, P, P], P),
    "ggml_geglu_split": ([P, P, P], P),
    "ggml_swiglu_oai": ([P, P, P, c_float, c_float], P),
    "ggml_view_1d": ([P, P, c_int64, c_size_t], P),
    "ggml_view_2d": ([P, P, c_int64, c_int64, c_size_t, c_size_t], P),
    "ggml_view_3d": ([P, P, c_int64, c_int64, c_int64, c_size_t, c_size_t, c_size_t], P),
    "ggml_reshape_1d": ([P, P, c_int64], P),
    "ggml_reshape_2d": ([P, P, c_int64, c_int64], P),
    "ggml_reshape_3d": ([P, P, c_int64, c_int64, c_int64], P),
    "ggml_reshape_4d": ([P, P, c_int64, c_int64, c_int64, c_int64], P),
    "ggml_permute": ([P, P, c_int, c_int, c_int, c_int], P),
    "ggml_cont": ([P, P], P),
    "ggml_concat": ([P, P, P, c_int], P),
    "ggml_cpy": ([P, P, P], P),
    "ggml_cast": ([P, P, c_int], P),
    # backends, buffers
    "ggml_backend_cpu_init": ([], P),
    "ggml_backend_cpu_set_n_threads": ([P, c_int], None),
    "ggml_backend_free": ([P], None),
    "ggml_backend_name": ([P], c_char_p),
    "ggml_backend_get_device": ([P], P),
    "ggml_backend_get_default_buffer_type": ([P], P),
    "ggml_backend_cpu_buffer_from_ptr": ([P, c_size_t], P),
    "ggml_backend_cpu_buffer_type": ([], P),
    "ggml_backend_tensor_alloc": ([P, P, P], c_int),
    "ggml_backend_alloc_ctx_tensors": ([P, P], P),
    "ggml_backend_alloc_ctx_tensors_from_buft": ([P, P], P),
    "ggml_backend_buffer_free": ([P], None),
    "ggml_backend_buffer_clear": ([P, c_uint8], None),
    "ggml_backend_buffer_get_size": ([P], c_size_t),
    "ggml_backend_buffer_get_base": ([P], P),
    "ggml_backend_buffer_set_usage": ([P, c_int], None),
    "ggml_backend_buft_alloc_buffer": ([P, c_size_t], P),
    "ggml_backend_buft_name": ([P], c_char_p),
    "ggml_backend_tensor_set": ([P, P, c_size_t, c_size_t], None),
    "ggml_backend_tensor_get": ([P, P, c_size_t, c_size_t], None),
    "ggml_backend_tensor_memset": ([P, c_uint8, c_size_t, c_size_t], None),
    "ggml_backend_tensor_copy": ([P, P], None),
    "ggml_backend_graph_compute": ([P, P], c_int),
    "ggml_backend_synchronize": ([P], None),
    "ggml_backend_sched_new": ([POINTER(P), POINTER(P), c_int, c_size_t, c_bool, c_bool], P),
    "ggml_backend_sched_free": ([P], None),
    "ggml_backend_sched_reset": ([P], None),
    "ggml_backend_sched_reserve": ([P, P], c_bool),
    "ggml_backend_sched_alloc_graph": ([P, P], c_bool),
    "ggml_backend_sched_graph_compute": ([P, P], c_int),
    "ggml_backend_sched_get_buffer_size": ([P, P], c_size_t),
    # devices and registries
    "ggml_backend_dev_count": ([], c_size_t),
    "ggml_backend_dev_get": ([c_size_t], P),
    "ggml_backend_dev_name": ([P], c_char_p),
    "ggml_backend_dev_description": ([P], c_char_p),
    "ggml_backend_dev_memory": ([P, POINTER(c_size_t), POINTER(c_size_t)], None),
    "ggml_backend_dev_type": ([P], c_int),
    "ggml_backend_dev_init": ([P, c_char_p], P),
    "ggml_backend_dev_buffer_type": ([P], P),
    "ggml_backend_dev_backend_reg": ([P], P),
    "ggml_backend_reg_name": ([P], c_char_p),
    "ggml_backend_reg_count": ([], c_size_t),
    "ggml_backend_reg_get": ([c_size_t], P),
    "ggml_backend_reg_dev_count": ([P], c_size_t),
    "ggml_backend_reg_get_proc_address": ([P, c_char_p], P),
    # types
    "ggml_get_type_traits": ([c_int], P),
}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits (the same in 0.15.3 and 0.25.3)
    _fields_ = [
        ("type_name", c_char_p),
        ("blck_size", c_int64),
        ("blck_size_interleave", c_int64),
        ("type_size", c_size_t),
        ("is_quantized", c_bool),
        ("to_float", c_void_p),
        ("from_float_ref", c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_int64)


def dequantize_rows(
    qtype: int, raw: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], threads: int = 1
) -> None:
    """ggml's own dequantization of rows of `qtype` (raw: uint8 [rows, bytes per row], C order)
    into f32 `out` [rows, n] (C order), cut by rows over `threads` threads (the GIL is let go
    during each call)."""
    traits = ctypes.cast(lib.ggml_get_type_traits(qtype), ctypes.POINTER(_TypeTraits)).contents
    if not traits.to_float:
        raise BackendError(f"ggml cannot dequantize type {qtype}")
    fn = _TO_FLOAT(traits.to_float)
    rows, n = out.shape
    if raw.shape[0] != rows or not (raw.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("dequantize_rows: raw [rows, bytes] and out [rows, n], C-contiguous")
    row_bytes = raw.shape[1]

    def part(a: int, b: int) -> None:
        if b > a:
            fn(raw.ctypes.data + a * row_bytes, out.ctypes.data + a * n * 4, (b - a) * n)

    cuts = [rows * i // threads for i in range(threads + 1)]
    if threads <= 1 or rows < 2 * threads:
        part(0, rows)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, cuts[:-1], cuts[1:]))


class _Feature(ctypes.Structure):  # struct ggml_backend_feature
    _fields_ = [("name", c_char_p), ("value", c_char_p)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)
_LOG_WARN, _LOG_CONT = 3, 5  # enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
_last_level = [0]


def _log_line(level: int, text: bytes | None, _user: int | None) -> None:
    """ggml's log: warnings and errors to stderr; its debug and info lines (every tensor it
    repacks, every buffer it allocates) are not for users."""
    if level != _LOG_CONT:
        _last_level[0] = level
    if _last_level[0] >= _LOG_WARN and text:
        import sys

        sys.stderr.write(text.decode(errors="replace"))


LLAMA_CPP_PYTHON = "llama-cpp-python"  # use_library's name for that package's build of ggml
BUILT = Path(__file__).resolve().parent.parent / "_ggml"  # where the install puts ggml
BUILT_NAME = "potluck"  # version()'s name for that build
# as the README installs it
REBUILD = (
    'CMAKE_ARGS="-DGGML_LLAMAFILE=ON" pip install --force-reinstall --no-deps -e . '
    "(in the clone of Potluck)"
)
_library: list[tuple[Path, str]] = []  # use_library's choice: (folder, what to call it)


def library_file(name: str) -> str:
    """The file of ggml's library `name` ("ggml", "ggml-base", "ggml-cpu") as ggml's CMake names it
    on this system: libggml.so on Linux, libggml.dylib on macOS, ggml.dll on Windows (ggml drops
    the lib prefix there)."""
    if sys.platform == "win32":
        return f"{name}.dll"
    return f"lib{name}.dylib" if sys.platform == "darwin" else f"lib{name}.so"


GGML_FILE = library_file("ggml")  # the library every declaration below is looked up in


def use_library(where: str) -> None:
    """Compute with the ggml in folder `where` (its GGML_FILE, beside its libggml-base and
    backend libraries), or with llama-cpp-python's (`where` = "llama-cpp-python"), instead of
    the one Potluck's install built. Only before the first ggml call; BackendError if there is no
    such build."""
    if _lib.cache_info().currsize:
        raise RuntimeError("use_library after ggml was loaded")
    if where == LLAMA_CPP_PYTHON:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise BackendError(
                f"POTLUCK_GGML={LLAMA_CPP_PYTHON}, but llama-cpp-python is not installed; "
                'install it (CMAKE_ARGS as for Potluck: pip install "llama-cpp-python==0.3.36") '
                "or unset POTLUCK_GGML to use the ggml Potluck's install built"
            )
        folder, name = Path(spec.submodule_search_locations[0]) / "lib", LLAMA_CPP_PYTHON
    else:
        folder, name = Path(where).expanduser(), str(Path(where).expanduser())
    if not (folder / GGML_FILE).is_file():
        raise BackendError(
            f"POTLUCK_GGML={where}: no {GGML_FILE} in {folder}; name the folder of a ggml build "
            f"(its {GGML_FILE} and {library_file('ggml-base')}), or {LLAMA_CPP_PYTHON}"
        )
    _library[:] = [(folder, name)]


def _load_folder(folder: Path) -> ctypes.CDLL:
    """GGML_FILE of a ggml build in `folder`, after the libraries it needs from there (global,
    so that its backends find libggml-base's symbols whatever their rpath says)."""
    mode = getattr(ctypes, "RTLD_GLOBAL", 0)
    for dep in ("ggml-base", "ggml-cpu"):
        if (folder / library_file(dep)).is_file():
            ctypes.CDLL(str(folder / library_file(dep)), mode=mode)
    return ctypes.CDLL(str(folder / GGML_FILE), mode=mode)


def toolkit_dll_folders(env: Mapping[str, str]) -> None:
    """Windows, a workaround: Python loads a DLL's dependencies from its own folder and System32,
    not from PATH, so a CUDA (or HIP) build's runtime DLLs are found through the toolkit's
    folder, which its installer names in CUDA_PATH (HIP_PATH), as llama-cpp-python does. Called
    by the CLI (the environment is read there) before ggml is loaded; a no-op elsewhere."""
    if sys.platform != "win32":
        return
    for var in ("CUDA_PATH", "HIP_PATH"):
        root = env.get(var)
        if root and (Path(root) / "bin").is_dir():
            os.add_dll_directory(str(Path(root) / "bin"))


class _Lib:
    """The declared functions as attributes: `lib.ggml_mul_mat(ctx, a, b)`."""

    def __init__(self) -> None:
        folder, self.source = _library[0] if _library else (BUILT, BUILT_NAME)
        if not (folder / GGML_FILE).is_file():
            raise BackendError(
                f"ggml is not built: no {GGML_FILE} in {folder}; reinstall Potluck, which compiles "
                f"it (a C/C++ compiler and CMake are needed): {REBUILD}"
            )
        try:
            handle = _load_folder(folder)
        except OSError as exc:
            raise BackendError(
                f"the ggml in {folder} could not be loaded ({exc}); rebuild it: {REBUILD}"
            ) from exc
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.argtypes, fn.restype = args, res
            setattr(self, name, fn)
        self.ggml_init.argtypes = [_InitParams]
        self.handle = handle
        self._log = _LOG_CALLBACK(_log_line)  # kept: ggml calls it for as long as it runs
        self.ggml_log_set(ctypes.cast(self._log, c_void_p), None)

    def __getattr__(self, name: str) -> Any:  # only for names not declared above
        raise AttributeError(f"ggml function {name} is not declared in potluck.model.ggml_lib")


@functools.cache
def _lib() -> _Lib:
    return _Lib()


class _Proxy:
    def __getattr__(self, name: str) -> Any:
        return getattr(_lib(), name)


lib: Any = _Proxy()
# ggml_backend_buffer_usage: a buffer of weights makes ggml's scheduler run each op where its
# weights are (an op over a weight in RAM on the CPU, whatever device its input comes from)
BUFFER_USAGE_WEIGHTS = 1

# ggml enums (ggml.h) that the gguf package has no table for
PREC_F32 = 10  # GGML_PREC_F32
ROPE_NORMAL, ROPE_NEOX, ROPE_IMROPE = 0, 2, 40  # GGML_ROPE_TYPE_* (IMROPE: interleaved M-RoPE)
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3  # enum ggml_backend_dev_type
TYPE_F32, TYPE_F16, TYPE_I32, TYPE_I64 = 0, 1, 26, 27  # enum ggml_type (= gguf's numbering)
STATUS_SUCCESS = 0


def context(n_tensors: int, graph_nodes: int = 0) -> int:
    """A ggml context that holds only tensor and graph metadata (no_alloc: data lives in buffers)."""
    size = n_tensors * lib.ggml_tensor_overhead()
    if graph_nodes:
        size += lib.ggml_graph_overhead_custom(graph_nodes, False)
    ctx: int | None = lib.ggml_init(_InitParams(size, None, True))  # None: NULL
    if not ctx:
        raise BackendError(f"ggml_init failed for a context of {size:,} bytes")
    return ctx


@dataclass(frozen=True)
class Device:
    """One ggml device: `index` in ggml's device list, its kind, and memory as ggml measures it."""

    index: int
    name: str  # e.g. "CPU", "Vulkan0", "CUDA0"
    description: str
    kind: str  # "cpu" | "gpu" | "igpu" | "accel"
    free_bytes: int
    total_bytes: int

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")


_KINDS = {DEV_CPU: "cpu", DEV_GPU: "gpu", DEV_IGPU: "igpu", DEV_ACCEL: "accel"}


def devices() -> list[Device]:
    """Every device this machine's ggml can use, CPU included."""
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = c_size_t(0), c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            Device(
                i,
                lib.ggml_backend_dev_name(dev).decode(),
                lib.ggml_backend_dev_description(dev).decode(),
                _KINDS.get(lib.ggml_backend_dev_type(dev), "accel"),
                int(free.value),
                int(total.value),
            )
        )
    return out


def gpu_device(name: str | None = None) -> tuple[int, Device]:
    """(ggml device handle, its Device) of the GPU called `name` ("Vulkan0", "CUDA0", ...), or of
    the first GPU when name is None. BackendError when there is none, saying what there is."""
    found = devices()
    for d in found:
        if (name is None and d.is_gpu) or (name is not None and d.name.lower() == name.lower()):
            return lib.ggml_backend_dev_get(d.index), d
    have = ", ".join(d.name for d in found) or "none"
    want = f"device {name!r}" if name else "GPU"
    raise BackendError(
        f"this machine's ggml has no {want} (devices: {have}); build ggml with a GPU backend: "
        'CMAKE_ARGS="-DGGML_LLAMAFILE=ON -DGGML_VULKAN=ON" (or -DGGML_CUDA=ON, -DGGML_HIP=ON, -DGGML_METAL=ON) '
        "pip install --force-reinstall --no-deps -e . (in the clone of Potluck)"
    )


def registries() -> dict[str, int]:
    """The backends this ggml was built with ("CPU", "Vulkan", "CUDA", ...) and how many devices
    each found on this machine."""
    out = {}
    for i in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(i)
        out[lib.ggml_backend_reg_name(reg).decode()] = int(lib.ggml_backend_reg_dev_count(reg))
    return out


# where the Vulkan loader looks for drivers (ICD manifests) on Linux, unless VK_DRIVER_FILES /
# VK_ICD_FILENAMES name them
VULKAN_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


def device_advice(
    env: Mapping[str, str],
    found: dict[str, int] | None = None,
    icd_dirs: Sequence[str] = VULKAN_ICD_DIRS,
) -> str | None:
    """Why a GPU backend this ggml was built with found no device, and what to do; None when each
    found one (or none was built in). env: the process's environment (the Vulkan loader's and
    ggml's variables; the CLI passes it); found: registries() (the default)."""
    found = registries() if found is None else found
    empty = sorted(name for name, n in found.items() if n == 0 and name not in ("CPU", "BLAS"))
    if not empty:
        return None
    if empty != ["Vulkan"]:
        return (
            f"ggml was built with {', '.join(empty)} but finds no device there: check the "
            "GPU's driver (nvidia-smi for CUDA, rocminfo for ROCm), then run potluck again"
        )
    named = env.get("VK_DRIVER_FILES") or env.get("VK_ICD_FILENAMES")
    drivers = (
        [Path(f).name for f in named.split(os.pathsep) if f]
        if named
        else sorted(p.name for d in icd_dirs for p in Path(d).glob("*.json"))
    )
    if not drivers:
        return (
            "ggml was built with Vulkan but this machine has no Vulkan driver: install the GPU's "
            "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers for AMD and Intel; NVIDIA's "
            "driver brings its own), check with vulkaninfo --summary"
        )
    software = any(d.startswith("lvp_icd") for d in drivers)
    hidden = (
        "; Mesa's software device (lavapipe) is left out unless GGML_VK_VISIBLE_DEVICES=0 names "
        "it (it computes on the CPU, slower than the CPU backend: for tests)"
        if software and not env.get("GGML_VK_VISIBLE_DEVICES")
        else ""
    )
    if all(d.startswith("lvp_icd") for d in drivers):
        return (
            "ggml was built with Vulkan but the only Vulkan driver here is Mesa's software "
            f"device (lavapipe){hidden}; for a GPU install its driver (mesa-vulkan-drivers for "
            "AMD and Intel, NVIDIA's driver)"
        )
    return (
        f"ggml was built with Vulkan and this machine has Vulkan drivers ({', '.join(drivers)}) "
        "but none found a GPU: check that the GPU's own driver is installed and see "
        "vulkaninfo --summary; GGML_VK_VISIBLE_DEVICES, if set, must name a device it lists"
        f"{hidden}"
    )


def _cpu_proc(name: bytes) -> tuple[int, int, int] | None:
    """(CPU device, its backend registry, the address of its extension function `name`), None
    where this ggml has no CPU device or no such function."""
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if lib.ggml_backend_dev_type(dev) == DEV_CPU:
            reg = lib.ggml_backend_dev_backend_reg(dev)
            addr = lib.ggml_backend_reg_get_proc_address(reg, name)
            return (dev, reg, addr) if addr else None
    return None


@functools.cache
def repack_buffer_type() -> int | None:
    """The CPU backend's CPU_REPACK buffer type (weights interleaved for its fastest matmul
    kernels, as llama.cpp's --repack), None where this ggml has none."""
    found = _cpu_proc(b"ggml_backend_dev_get_extra_bufts")
    if found is None:
        return None
    dev, _, addr = found
    extra = ctypes.CFUNCTYPE(POINTER(c_void_p), c_void_p)(addr)(dev)
    k = 0
    while extra and extra[k]:
        if lib.ggml_backend_buft_name(extra[k]) == b"CPU_REPACK":
            return int(extra[k])
        k += 1
    return None


class _Tensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h; the same in ggml 0.15 and 0.25): read for `extra` only."""

    _fields_ = [
        ("type", c_int),
        ("buffer", c_void_p),
        ("ne", c_int64 * 4),  # GGML_MAX_DIMS
        ("nb", c_size_t * 4),
        ("op", c_int),
        ("op_params", ctypes.c_int32 * 16),  # GGML_MAX_OP_PARAMS / sizeof(int32_t)
        ("flags", ctypes.c_int32),
        ("src", c_void_p * 10),  # GGML_MAX_SRC
        ("view_src", c_void_p),
        ("view_offs", c_size_t),
        ("data", c_void_p),
        ("name", ctypes.c_char * 64),  # GGML_MAX_NAME
        ("extra", c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def tensor_extra(t: int) -> int:
    """A tensor's `extra` pointer (the repack buffer sets it to the layout it chose, NULL when it
    has none for that type and shape)."""
    return int(ctypes.cast(t, POINTER(_Tensor)).contents.extra or 0)


def tensor_ne(t: int) -> tuple[int, ...]:
    """A tensor's shape as ggml holds it (ne, innermost first, 4 dims)."""
    return tuple(ctypes.cast(t, POINTER(_Tensor)).contents.ne)


def version() -> str:
    """ggml's version and which build it is: "0.25.3 (potluck)"."""
    return f"{lib.ggml_version().decode()} ({_lib().source})"


def cpu_features() -> dict[str, str]:
    """The CPU backend's compiled-in and detected features (AVX2, AVX512, FMA, OPENMP, ...)."""
    found = _cpu_proc(b"ggml_backend_get_features")
    if found is None:
        return {}
    _, reg, addr = found
    feats = ctypes.CFUNCTYPE(POINTER(_Feature), c_void_p)(addr)(reg)
    out, k = {}, 0
    while feats[k].name:
        out[feats[k].name.decode()] = feats[k].value.decode()
        k += 1
    return out


def build_advice() -> str | None:
    """What this machine's ggml build lacks that costs speed, and how to rebuild; None if nothing."""
    if not cpu_features().get("LLAMAFILE"):
        source = _lib().source
        how = REBUILD if source == BUILT_NAME else f"the ggml of {source}, with that flag"
        return (
            "ggml was built without LLAMAFILE (its tinyBLAS prompt kernels): prompts run up to "
            f"2x slower on Q8_0/Q5_0/F16 weights; rebuild it: {how}"
        )
    return None


def describe() -> str:
    """One line for the startup log and `potluck doctor`: devices and CPU features."""
    feats = cpu_features()
    flags = [k for k, v in feats.items() if v == "1" and k not in ("OPENMP", "REPACK")]
    extras = [k.lower() for k in ("OPENMP", "REPACK") if feats.get(k) == "1"]
    devs = ", ".join(
        f"{d.name}"
        + (f" ({d.description}, {d.free_bytes / 2**30:.1f} GiB free)" if d.is_gpu else "")
        for d in devices()
    )
    return f"ggml {version()}: {devs}; CPU {' '.join(flags) or 'baseline'}" + (
        f" ({', '.join(extras)})" if extras else ""
    )
