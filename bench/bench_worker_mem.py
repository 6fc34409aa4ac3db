"""A worker's memory against what it holds (issues 14 and 15): `potluck run` over one worker, the
model split in two (`--tensor-split 1,1`: the head runs the first half of the layers, the worker
the second), and the worker's RSS read from /proc while it computes.

    python bench/bench_worker_mem.py [--model qwen7b] [-c 512] [-p 64] [-n 32] [--no-vulkan]
        [--out bench/out/worker_mem.json]

The target (issue 14, issue 15): RSS during decode ≤ the worker's tensors + its KV cache + its
compute buffers + 100 MB. Tensors and KV are what the worker reports after loading; the buffers
are the planner's estimate for one micro-batch (planner/footprint.py: activation_bytes). The
worker is sampled every 20 ms while `potluck run` runs; reported: the idle process before any
load, the largest RSS seen once it had loaded (its anonymous and file-backed parts at that
moment), the kernel's peak (VmHWM, load included) and the RSS at the end of the run.
--no-vulkan hides the Vulkan drivers from the worker (VK_ICD_FILENAMES pointing at nothing): a
ggml built with Vulkan loads Mesa's drivers (lavapipe, LLVM) to list devices even on a machine
with no GPU; a CPU-only build never does. Never asserts anything.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, model_path, print_table, run_info, write_json  # noqa: E402

MIB = 2**20
ALLOWANCE = 100 * 10**6  # the target's "+ 100 MB"
PROMPT_WORD = "apple "  # one token per word in the Qwen2 vocabulary: -p N gives ≈ N tokens


def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of `pid` in bytes (from /proc/PID/status)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _worker(env: dict[str, str]) -> tuple[subprocess.Popen, str, list[str]]:
    """`potluck worker -t 1` pinned to core 1; (process, address, its log lines so far and after)."""
    proc = subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, "-m", "potluck.cli", "worker", "-p", "0", "-t", "1",
         "--no-mdns"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        said.append(line)
        if found := re.search(r"listening on [^ ]*:(\d+) ", line):
            threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
            return proc, f"127.0.0.1:{found[1]}", said
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("worker did not start:\n" + "".join(said))


def measure(path: Path, n_ctx: int, n_prompt: int, n_predict: int, vulkan: bool) -> dict:
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    if not vulkan:
        env["VK_ICD_FILENAMES"] = "/nonexistent.json"
    proc, addr, said = _worker(env)
    try:
        time.sleep(2.0)  # the Hello's background work (device list, hashing) settles
        idle = _status(proc.pid)
        run = subprocess.Popen(
            [sys.executable, "-m", "potluck.cli", "run", "-m", str(path), "--peer", addr,
             "--tensor-split", "1,1", "--no-mdns", "-c", str(n_ctx), "-n", str(n_predict),
             "--temp", "0", "--raw", "-t", "1", PROMPT_WORD * n_prompt],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        samples: list[dict[str, int]] = []
        loaded_at: int | None = None
        while run.poll() is None:
            samples.append(_status(proc.pid))
            if loaded_at is None and any("loaded plan" in line for line in said):
                loaded_at = len(samples)
            time.sleep(0.02)
        err = run.stderr.read() if run.stderr else ""
        if run.returncode != 0:
            raise SystemExit(f"potluck run failed ({run.returncode}):\n{err}")
        end = _status(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    loaded = next(line for line in said if "loaded plan" in line)
    found = re.search(
        r"layers (\d+)–(\d+) · weights ([\d.]+) MiB \+ KV ([\d.]+) MiB at -c (\d+)", loaded
    )
    assert found, loaded
    start, last = int(found[1]), int(found[2])
    weights, kv = float(found[3]) * MIB, float(found[4]) * MIB
    buffers = _buffers(path, n_ctx)
    after = samples[loaded_at or 0 :] or [end]
    top = max(after, key=lambda s: s["VmRSS"])
    limit = weights + kv + buffers + ALLOWANCE
    return {
        "layers": [start, last + 1],
        "vulkan": vulkan,
        "weights_bytes": weights,
        "kv_bytes": kv,
        "buffer_bytes": buffers,
        "limit_bytes": limit,
        "idle": idle,
        "max_after_load": top,
        "peak_hwm_bytes": end["VmHWM"],
        "end": end,
        "over_limit_bytes": top["VmRSS"] - limit,
        "run_said": err.splitlines()[-6:],
    }


def _buffers(path: Path, n_ctx: int) -> int:
    """The planner's compute-buffer estimate for one stage of this model at n_ctx."""
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.planner.footprint import DEFAULT_BATCH, activation_bytes

    f = GGUFFile(path)
    return activation_bytes(hparams_from_metadata(f.metadata), n_ctx, min(DEFAULT_BATCH, n_ctx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen7b", choices=MODEL_NAMES)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--no-vulkan", action="store_true", help="hide the Vulkan drivers (see above)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/worker_mem.json"))
    args = ap.parse_args()
    path = model_path(args.model)
    r = measure(path, args.ctx, args.n_prompt, args.n_predict, vulkan=not args.no_vulkan)
    mib = lambda b: f"{b / MIB:.0f}"  # noqa: E731
    top = r["max_after_load"]
    print_table(
        f"worker holding layers {r['layers'][0]}–{r['layers'][1] - 1} of {path.name} "
        f"(-c {args.ctx}, Vulkan {'on' if r['vulkan'] else 'hidden'}), MiB",
        ["idle RSS", "weights", "KV", "buffers", "limit (+100 MB)", "RSS after load (anon / file)",
         "VmHWM", "RSS at end", "over the limit"],
        [[mib(r["idle"]["VmRSS"]), mib(r["weights_bytes"]), mib(r["kv_bytes"]),
          mib(r["buffer_bytes"]), mib(r["limit_bytes"]),
          f"{mib(top['VmRSS'])} ({mib(top['RssAnon'])} / {mib(top['RssFile'])})",
          mib(r["peak_hwm_bytes"]), mib(r["end"]["VmRSS"]), mib(r["over_limit_bytes"])]],
    )  # fmt: skip
    write_json(args.out, {"info": run_info(), "args": vars(args) | {"out": str(args.out)}, **r})


if __name__ == "__main__":
    main()
