"""Single-node speed and memory: potluck vs llama.cpp's own `llama-bench`, side by side in one run.

Per model × thread count × rep, one `llama-bench -r 1` process and one potluck child process run
back to back, in alternating order (A B, B A, ...), each loading the model fresh. Both run
llama-bench's two tests:
  ppP  prompt tokens/s: P random token ids in one forward call from an empty cache;
  tgN  decode tokens/s: N single-token steps from an empty cache (positions 0 .. N-1, no prompt).
Each process's peak RSS is its own ru_maxrss (os.wait4). Claims are ratios potluck / llama.cpp of
medians, on one CPU, in one run; nothing here asserts a time.

    python bench/bench_single.py
        [--models smollm2,gemma3,qwen7b,qwen30b-a3b,gpt-oss-20b,qwen36-35b-a3b]
        [--threads 1,2] [--reps 3] [--pp P --tg N] [--ngl N] [--llama-bin DIR]
        [--llama-repack 0|1|both] [--quick] [--out PATH]

--ngl N puts the last N layers on the first GPU in both engines (llama-bench -ngl N; potluck as
`potluck run -ngl N`); more than the model's layers puts the output head there too. Potluck
computes with the ggml that POTLUCK_GGML names, as the CLI does (--ggml adds a second potluck).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    ComputeClock,
    llama_bin_default,
    llama_tools,
    load_local,
    median,
    model_path,
    print_table,
    snapshot_src,
    write_json,
)

# (pp, tg): BENCHMARKS.md's; for the MoEs, qwen30b-a3b (BENCHMARKS.md's MoE target: decode and
# pp512), gpt-oss-20b and qwen36-35b-a3b (the hybrid), pp512 and a tg that keeps one process
# within ~3 min at 2 threads
TESTS = {
    "smollm2": (512, 128),
    "gemma3": (512, 128),
    "qwen7b": (64, 16),
    "qwen30b-a3b": (512, 32),
    "gpt-oss-20b": (512, 32),
    "qwen36-35b-a3b": (512, 32),
}
TOKEN_RANGE = (1000, 40000)  # ordinary ids in every vocabulary here (llama-bench: rand() % n_vocab)
SEED = 1234
TIMEOUT_S = 1800.0  # one process; the 7B at 1 thread takes a few minutes
REPACK = {"llama.cpp": 1, "llama.cpp-norepack": 0}  # engine -> llama-bench --repack
LABELS = {"llama.cpp": "llama-bench", "llama.cpp-norepack": "llama-bench --repack 0"}


# -- potluck child: one model, one thread count ----------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import potluck
    from potluck.model import ggml_lib, graph

    if where := spec.get("ggml") or os.environ.get("POTLUCK_GGML"):  # --ggml, else as the CLI
        ggml_lib.use_library(where)
    from potluck.model.stage import SeqChunk

    clock = ComputeClock(graph.lib)
    graph.lib = clock  # bench child only (see ComputeClock)
    pp, tg = spec["pp"], spec["tg"]
    t0 = time.perf_counter()
    if spec["ngl"]:  # the last ngl layers on the first GPU, as `potluck run -ngl N` puts them
        from potluck.cli.runtime import compute_of
        from potluck.pool.build import load_model

        compute = compute_of(spec["threads"], n_gpu_layers=spec["ngl"])
        model = load_model(spec["path"], n_ctx=max(pp, tg), compute=compute)
    else:  # llama-bench: n_ctx = pp + tg
        model = load_local(spec["path"], max(pp, tg), spec["threads"])
    load_s = time.perf_counter() - t0
    ready_at, rss_loaded = time.time(), _rss_mib()
    pipe = model.pipeline
    stage = pipe.stages[0]
    device = f"{d.name} ({d.description})" if (d := stage.gpu_device) else "CPU"
    rng = random.Random(SEED)
    ids = np.array([rng.randrange(*TOKEN_RANGE) for _ in range(max(pp, tg))], np.int64)

    def run(n_prompt: int, n_gen: int) -> tuple[float, float]:
        """(wall s, ggml compute s) of one n_prompt-token forward, or n_gen single-token steps,
        on a fresh sequence (dropped afterwards, outside the timed part)."""
        seq = model.new_seq_id()
        try:
            c0, t0 = clock.seconds, time.perf_counter()
            if n_prompt:
                pipe.forward(ids[:n_prompt], [SeqChunk(seq, n_prompt)])
            for i in range(n_gen):
                pipe.forward(ids[i : i + 1], [SeqChunk(seq, 1)])
            return time.perf_counter() - t0, clock.seconds - c0
        finally:
            pipe.drop(seq)

    # warm-up as llama-bench's: the whole prompt once, then decode steps (it does 1, here 4)
    run(pp, 0)
    run(0, 4)
    pp_s, pp_c = run(pp, 0)
    tg_s, tg_c = run(0, tg)
    return {"pp_ts": pp / pp_s, "tg_ts": tg / tg_s, "pp_compute_share": pp_c / pp_s,
            "tg_ms": 1e3 * tg_s / tg, "tg_compute_ms": 1e3 * tg_c / tg,
            "tg_overhead_ms": 1e3 * (tg_s - tg_c) / tg, "load_s": load_s, "ready_at": ready_at,
            "rss_loaded_mib": rss_loaded, "potluck_from": potluck.__file__, "ggml": ggml_lib.version(),
            "device": device, "gpu_weights_mib": stage.device_weight_bytes() / 2**20}  # fmt: skip


# -- parent side -----------------------------------------------------------------------------------
def _spawn(cmd: list[str], threads: int, pythonpath: str | None = None) -> dict[str, Any]:
    """Run cmd to its end: exit code, output, wall seconds, the process's own peak RSS (its rusage
    from os.wait4, the figure `/usr/bin/time -v` prints), its CPU share: CPU seconds per wall
    second per thread, well under 1 when other work on the machine took the cores (or it waited
    for the disk), and its major page faults: faults that had to read the disk (a model's mapped
    weights that were not, or no longer, in the page cache)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started, t0 = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        killer = threading.Timer(TIMEOUT_S, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        return {"rc": proc.returncode, "stdout": out.read(), "stderr": err.read(),
                "started_at": started, "proc": {"peak_rss_mib": usage.ru_maxrss / 1024,
                "wall_s": wall, "cpu_share": (usage.ru_utime + usage.ru_stime) / (wall * threads),
                "major_faults": usage.ru_majflt}}  # fmt: skip


SIGILL_HINT = (  # seen on a VM whose CPU lists AMX: ggml's AMX kernels (llama-bench --repack 1) die
    "SIGILL: an instruction this machine does not run (a -march=native build's AMX kernels on a "
    "VM without AMX state?): build llama.cpp with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (README)"
)


def _failed(r: dict[str, Any]) -> dict[str, Any]:
    tail = r["stderr"].strip().splitlines()[-15:]
    return {
        "error": f"exit {r['rc']}",
        "stderr_tail": tail + [SIGILL_HINT] * (r["rc"] == -signal.SIGILL),
    }


def llama_sample(
    bin_dir: Path, path: str, t: int, pp: int, tg: int, repack: int, ngl: int = 0
) -> dict[str, Any]:
    cmd = [str(bin_dir / "llama-bench"), "-m", path, "-t", str(t), "-p", str(pp), "-n", str(tg),
           "-r", "1", "-ngl", str(ngl), "--repack", str(repack), "-o", "json"]  # fmt: skip
    r = _spawn(cmd, t)
    if r["rc"] != 0:
        return _failed(r)
    tests = json.loads(r["stdout"])
    pp_t = next(x for x in tests if x["n_prompt"] > 0 and x["n_gen"] == 0)
    tg_t = next(x for x in tests if x["n_gen"] > 0 and x["n_prompt"] == 0)
    pp_s, tg_s = pp_t["samples_ns"][0] / 1e9, tg_t["samples_ns"][0] / 1e9
    # llama-bench reports no load time: the process's wall time less the timed runs and their
    # warm-ups (the whole prompt; one decode step) ~ start, load, two contexts, exit
    ready = r["proc"]["wall_s"] - 2 * pp_s - tg_s * (1 + 1 / tg)
    return {"pp_ts": pp_t["avg_ts"], "tg_ts": tg_t["avg_ts"], "tg_ms": 1e3 * tg_s / tg,
            "ready_s": ready, **r["proc"], "build_commit": pp_t.get("build_commit"),
            "cpu_info": pp_t.get("cpu_info"), "device": (pp_t.get("gpu_info") or "CPU") if ngl else "CPU",
            "backends": pp_t.get("backends"), "n_gpu_layers": pp_t.get("n_gpu_layers")}  # fmt: skip


def potluck_sample(
    path: str, t: int, pp: int, tg: int, src: str | None, ggml: str | None = None, ngl: int = 0
) -> dict[str, Any]:
    spec = json.dumps({"path": path, "threads": t, "pp": pp, "tg": tg, "ggml": ggml, "ngl": ngl})
    r = _spawn([sys.executable, str(Path(__file__).resolve()), "--child", spec], t, src)
    lines = [x for x in r["stdout"].splitlines() if x.startswith("RESULT ")]
    if r["rc"] != 0 or not lines:
        return _failed(r)
    res = json.loads(lines[-1][len("RESULT ") :])
    ready_s = res.pop("ready_at") - r["started_at"]  # spawn -> model loaded, interpreter included
    return {**res, "ready_s": ready_s, **r["proc"]}


def _out(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).rstrip()  # (git status's leading columns stay)


def machine_info(llama_bin: Path | None) -> dict[str, Any]:
    """CPU (lscpu), ggml as potluck sees it, llama-bench's build, git state, date, load."""
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (x.partition(":") for x in _out(["lscpu"]).splitlines())
    )
    flags = [f for f in fields.get("Flags", "").split()
             if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "avx_vnni", "amx"))]  # fmt: skip
    try:
        from potluck.model.ggml_lib import BackendError, describe, use_library

        try:
            if where := os.environ.get("POTLUCK_GGML"):  # the build the children compute with
                use_library(where)
            ggml = describe()
        except BackendError as e:
            ggml = f"unavailable: {e}"
    except ImportError as e:
        ggml = f"unavailable: {e}"
    dirty = _out(["git", "-C", str(ROOT), "status", "--porcelain"]).splitlines()
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cpu_model": fields.get("Model name", platform.processor()), "cpu_flags": flags,
            "cpu_family_model": f"{fields.get('CPU family')}/{fields.get('Model')}",
            "n_cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
            "python": platform.python_version(), "ggml": ggml,
            "llama_bench": _out([str(llama_bin / "llama-bench"), "--version"]) if llama_bin else None,
            "git_commit": _out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
            "git_dirty": bool(dirty), "git_dirty_paths": [x[3:] for x in dirty]}  # fmt: skip


METRICS = [  # sample key, label, unit, number format
    ("pp_ts", "pp{pp}", "t/s", "{:.1f}"), ("tg_ts", "tg{tg}", "t/s", "{:.1f}"),
    ("peak_rss_mib", "peak RSS", "MiB", "{:.0f}"), ("rss_loaded_mib", "RSS after load", "MiB", "{:.0f}"),
    ("ready_s", "spawn → loaded", "s", "{:.2f}"), ("load_s", "load_model()", "s", "{:.2f}"),
    ("tg_ms", "tg per token", "ms", "{:.2f}"), ("tg_compute_ms", "  in ggml compute", "ms", "{:.2f}"),
    ("tg_overhead_ms", "  Python overhead", "ms", "{:.2f}"),
    ("cpu_share", "CPU share", "cores/thread", "{:.2f}"),
    ("major_faults", "major page faults", "count", "{:.0f}"),
]  # fmt: skip


def summarize(samples: list[dict[str, Any]], engines: list[str]) -> tuple[list[dict], list[list]]:
    """Per (model, threads, metric): each engine's median/min/max, potluck / reference (the first
    llama.cpp engine) of the medians, and the paired ratio (median of per-rep ratios)."""
    ok = [s for s in samples if "error" not in s]
    ref = next((e for e in engines if not e.startswith("potluck")), None)
    ours = [e for e in engines if e.startswith("potluck")]  # potluck, potluck-ggml (--ggml)
    summary: list[dict] = []
    rows: list[list] = []
    for name, t, pp, tg in dict.fromkeys((s["model"], s["threads"], s["pp"], s["tg"]) for s in ok):
        group = [s for s in ok if (s["model"], s["threads"]) == (name, t)]
        for key, label, unit, fmt in METRICS:
            by = {
                e: {s["rep"]: s[key] for s in group if s["engine"] == e and key in s}
                for e in engines
            }
            if not any(by.values()):
                continue
            entry: dict[str, Any] = {"model": name, "threads": t, "metric": key, "unit": unit}
            cells = []
            for e in engines:
                v = list(by[e].values())
                entry[e] = {"median": median(v), "min": min(v, default=None), "max": max(v, default=None), "n": len(v)}  # fmt: skip
                cell = fmt.format(median(v)) if v else "—"
                cells.append(cell + (f" ({fmt.format(min(v))}–{fmt.format(max(v))})" if len(v) > 1 else ""))  # fmt: skip
            a = by[ref] if ref else {}
            ratios = []
            for e in ours:  # "ratio"/"paired_ratio" for potluck, "ratio_potluck-ggml"/... beside
                b = by.get(e, {})
                ma, mb = median(list(a.values())), median(list(b.values()))
                tag = "" if e == "potluck" else f"_{e}"
                entry["ratio" + tag] = mb / ma if ma and mb else None
                entry["paired_ratio" + tag] = median([b[r] / a[r] for r in a if r in b and a[r]])
                ratios += [f"{entry['ratio' + tag]:.2f}×" if entry["ratio" + tag] else "—",
                           f"{entry['paired_ratio' + tag]:.2f}×" if entry["paired_ratio" + tag] else "—"]  # fmt: skip
            summary.append(entry)
            rows.append([name, str(t), f"{label.format(pp=pp, tg=tg)} ({unit})", *cells, *ratios])
    return summary, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3", help=f"of {', '.join(TESTS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3, help="processes per engine (alternating order)")
    ap.add_argument("--pp", type=int, help="prompt tokens for every model (default: per model)")
    ap.add_argument("--tg", type=int, help="decode steps for every model (default: per model)")
    ap.add_argument("--ngl", type=int, default=0, help="layers on the first GPU, both engines "
                    "(llama-bench -ngl; potluck run -ngl); 0: CPU only")  # fmt: skip
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin (default: $LLAMA_CPP_BIN, else the vendored build)",
                    default=llama_bin_default())  # fmt: skip
    ap.add_argument("--llama-repack", choices=("0", "1", "both"), default="1",
                    help="llama-bench --repack (1 = its default, BENCHMARKS.md's reference)")  # fmt: skip
    ap.add_argument("--ggml", help="also potluck on this build of ggml (engine potluck-ggml, "
                    "alternating with the others): a folder with libggml.so, or llama-cpp-python "
                    "(as POTLUCK_GGML)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="1 rep, smollm2, pp128 tg32: a smoke test")
    ap.add_argument("--live-src", action="store_true",
                    help="children import src/ as it is at each moment, not a copy frozen at start")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "single.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_main(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.reps, args.models, args.pp, args.tg = 1, "smollm2", 128, 32
    models, threads = args.models.split(","), [int(t) for t in args.threads.split(",")]
    if unknown := [m for m in models if m not in TESTS]:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(TESTS)}")
    llama_bin: Path | None = args.llama_bin
    engines = {"1": ["llama.cpp"], "0": ["llama.cpp-norepack"],
               "both": ["llama.cpp", "llama.cpp-norepack"]}[args.llama_repack] + ["potluck"]  # fmt: skip
    if args.ggml:
        engines.append("potluck-ggml")
    llama_bin = llama_tools(llama_bin, "llama-bench")
    if llama_bin is None:
        print("Skipping llama.cpp: potluck figures only, no ratios.")
        engines = [e for e in engines if e.startswith("potluck")]
    info = machine_info(llama_bin)
    print(f"commit {info['git_commit']}{' (+ uncommitted changes)' if info['git_dirty'] else ''} · "
          f"{info['cpu_model']} × {info['n_cpus']} [{' '.join(info['cpu_flags'])}] · {info['ggml']} · "
          f"load avg {info['loadavg_start'][0]:.2f}")  # fmt: skip
    snap = None
    if not args.live_src:
        snap, info["src_sha256"] = snapshot_src(Path(args.out).with_suffix(".src"))
        info["src_snapshot"] = str(snap)

    samples: list[dict[str, Any]] = []
    for name in models:
        path = str(model_path(name))
        pp, tg = args.pp or TESTS[name][0], args.tg or TESTS[name][1]
        for t in threads:
            for rep in range(args.reps):
                for engine in engines if rep % 2 == 0 else engines[::-1]:
                    load = os.getloadavg()[0]  # the machine is shared: keep the context
                    if engine.startswith("potluck"):
                        ggml = args.ggml if engine == "potluck-ggml" else None
                        res = potluck_sample(path, t, pp, tg, str(snap) if snap else None, ggml,
                                             args.ngl)  # fmt: skip
                    else:
                        assert llama_bin is not None
                        res = llama_sample(llama_bin, path, t, pp, tg, REPACK[engine], args.ngl)
                    samples.append({"model": name, "threads": t, "rep": rep, "engine": engine,
                                    "pp": pp, "tg": tg, "ngl": args.ngl, "loadavg_1m_before": load,
                                    **res})  # fmt: skip
                    if "error" in res:
                        print(f"  {name} t={t} rep {rep} {engine}: FAILED {res['error']}")
                        print("    " + "\n    ".join(res["stderr_tail"]))
                        continue
                    extra = f" overhead {res['tg_overhead_ms']:.2f} ms/tok" if "tg_overhead_ms" in res else ""  # fmt: skip
                    print(f"  {name} t={t} rep {rep} {engine:18s} pp{pp} {res['pp_ts']:.1f} "
                          f"tg{tg} {res['tg_ts']:.1f} t/s peak {res['peak_rss_mib']:.0f} MiB "
                          f"cpu {res['cpu_share']:.2f} majflt {res['major_faults']} ({res['wall_s']:.0f} s) "
                          f"on {res['device']}{extra}")  # fmt: skip
    info["loadavg_end"] = list(os.getloadavg())

    summary, rows = summarize(samples, engines)
    header = ["model", "t", "metric", *(LABELS.get(e, e) for e in engines)]
    for e in (e for e in engines if e.startswith("potluck")):
        header += [f"{e} / llama.cpp", "paired"]
    print_table(f"potluck vs llama.cpp, -ngl {args.ngl}: medians (min–max); ratio of medians; "
                "paired = median of per-rep ratios", header, rows)  # fmt: skip
    config = {"ggml": args.ggml, "potluck_ggml": os.environ.get("POTLUCK_GGML"), "ngl": args.ngl,
              "models": models, "threads": threads, "reps": args.reps, "engines": engines,
              "pp": args.pp, "tg": args.tg, "tests": TESTS, "token_seed": SEED,
              "token_range": list(TOKEN_RANGE), "llama_bin": str(llama_bin) if llama_bin else None,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}  # fmt: skip
    out = Path(args.out)
    write_json(out, {"info": info, "config": config, "samples": samples, "summary": summary,
                     "table": {"header": header, "rows": rows}})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
