"""Single-node speed and memory: potluck vs llama.cpp (llama-cpp-python), side by side in one run.

For each model and thread count, child processes alternate llama.cpp / potluck (A B, B A, ...), each
loading the model fresh, so neither pollutes the other's peak RSS and drift hits both alike. Each
child measures, after a short warm-up:
  pp128, pp512  prompt tokens/s of a fixed random-but-valid token list, one forward/eval call
                from an empty cache (timed `pp_inner` times per child);
  tg128         decode tokens/s: 128 single-token steps after an 8-token prompt, fed the same
                fixed tokens in both engines (no sampling in the timed loop);
  peak RSS      ru_maxrss of the child (load + all runs), and the RSS before / after loading.
Claims are ratios potluck / llama.cpp of medians; nothing here asserts a time.

    python bench/bench_single.py [--models smollm2,gemma3] [--threads 1,2] [--reps 3] [--quick]
                                 [--out bench/out/single.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

N_CTX = 1024
N_BATCH = 512
PP_SIZES = (128, 512)
TG_PROMPT = 8
TOKEN_RANGE = (1000, 40000)  # ordinary text tokens in both vocabularies (49152 and 262144 ids)
SEED = 1234

# llama-bench -r 5 medians from /work/shared/BENCHMARKS.md (tokens/s, low-high over runs): a check
# that llama-cpp-python's figures here are in the same place as the C++ tool's.
LLAMA_BENCH_REF = {
    ("smollm2", 1): {"pp128": "250–254", "pp512": "240–242", "tg128": "146–156"},
    ("smollm2", 2): {"pp128": "465–502", "pp512": "458–483", "tg128": "160–164"},
    ("gemma3", 1): {"pp128": "544–548", "pp512": "499–511", "tg128": "85–88"},
    ("gemma3", 2): {"pp128": "942–1036", "pp512": "892–951", "tg128": "93–96"},
}


# -- child side: one engine, one model, one thread count -------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _child_llama(spec: dict) -> dict:
    import llama_cpp

    t, toks = spec["threads"], spec["tokens"]
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        spec["path"], n_ctx=N_CTX, n_threads=t, n_threads_batch=t, n_batch=N_BATCH, verbose=False
    )
    load_s = time.perf_counter() - t0
    rss1 = _rss_mib()

    def pp(n: int) -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks[:n])
        return n / (time.perf_counter() - t0)

    def tg(n: int) -> float:
        llm.reset()
        llm.eval(toks[:TG_PROMPT])
        t0 = time.perf_counter()
        for tok in toks[TG_PROMPT : TG_PROMPT + n]:
            llm.eval([tok])
        return n / (time.perf_counter() - t0)

    def tg_raw(n: int) -> float:
        """The same decode straight through llama_decode, without llama-cpp-python's eval wrapper."""
        llm.reset()
        llm.eval(toks[:TG_PROMPT])  # clears the KV cache, then the prompt at positions 0..7
        one = (llama_cpp.llama_token * 1)()
        t0 = time.perf_counter()
        for tok in toks[TG_PROMPT : TG_PROMPT + n]:
            one[0] = tok
            if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
        dt = time.perf_counter() - t0
        llm.reset()
        return n / dt

    out = _measure(pp, tg, spec, load_s, rss0, rss1)
    out[f"tg{spec['tg_n']}_raw"] = [tg_raw(spec["tg_n"])]
    return out


def _child_potluck(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from potluck.engine.generate import load_model
    from potluck.model.stage import SeqChunk

    toks = spec["tokens"]
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    m = load_model(spec["path"], n_ctx=N_CTX)
    load_s = time.perf_counter() - t0
    rss1 = _rss_mib()
    pipe = m.pipeline

    def pp(n: int) -> float:
        seq = m.new_seq_id()
        ids = torch.tensor(toks[:n])
        try:
            t0 = time.perf_counter()
            pipe.forward(ids, [SeqChunk(seq, n)])
            return n / (time.perf_counter() - t0)
        finally:
            pipe.drop(seq)

    def tg(n: int) -> float:
        seq = m.new_seq_id()
        try:
            pipe.forward(torch.tensor(toks[:TG_PROMPT]), [SeqChunk(seq, TG_PROMPT)])
            t0 = time.perf_counter()
            for tok in toks[TG_PROMPT : TG_PROMPT + n]:
                pipe.forward(torch.tensor([tok]), [SeqChunk(seq, 1)])
            return n / (time.perf_counter() - t0)
        finally:
            pipe.drop(seq)

    import potluck

    with torch.inference_mode():
        return {**_measure(pp, tg, spec, load_s, rss0, rss1), "potluck_from": potluck.__file__}


def _measure(pp, tg, spec: dict, load_s: float, rss0: float, rss1: float) -> dict:
    pp(32)  # warm-up: first-call allocations, thread pools, page faults on the weights
    tg(4)
    out: dict = {}
    c0, w0 = os.times(), time.perf_counter()
    for n in PP_SIZES:
        out[f"pp{n}"] = [pp(n) for _ in range(spec["pp_inner"])]
    out[f"tg{spec['tg_n']}"] = [tg(spec["tg_n"])]
    c1, w1 = os.times(), time.perf_counter()
    # CPU seconds this process got per wall second while measuring, over the threads it asked for:
    # well under 1.0 means other work on the machine took the cores (or the engine idles threads).
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    out["cpu_share"] = cpu / ((w1 - w0) * spec["threads"])
    out["load_s"] = load_s
    out["rss_before_load_mib"] = rss0
    out["rss_after_load_mib"] = rss1
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    fn = _child_llama if spec["engine"] == "llama_cpp" else _child_potluck
    print("RESULT " + json.dumps(fn(spec)), flush=True)


# -- parent side -----------------------------------------------------------------------------------
def run_child(spec: dict, pythonpath: str | None = None) -> dict:
    env = dict(
        os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"])
    )
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {done.returncode}", "stderr_tail": tail}


def measure(models, threads, engines, reps, tokens, tg_n, pp_inner, pythonpath=None) -> list[dict]:
    """Run the children, alternating engine order per rep; one sample dict per child."""
    from _common import median, model_path

    samples: list[dict] = []
    for name in models:
        path = str(model_path(name))
        for t in threads:
            for rep in range(reps):
                order = engines if rep % 2 == 0 else engines[::-1]
                for engine in order:
                    spec = {"engine": engine, "path": path, "threads": t, "tokens": tokens,
                            "tg_n": tg_n, "pp_inner": pp_inner}  # fmt: skip
                    load_before = os.getloadavg()[0]  # the machine is shared: keep the context
                    t0 = time.perf_counter()
                    res = run_child(spec, pythonpath)
                    wall = time.perf_counter() - t0
                    samples.append({"model": name, "threads": t, "engine": engine, "rep": rep,
                                    "wall_s": wall, "loadavg_1m_before": load_before, **res})  # fmt: skip
                    if "error" in res:
                        print(f"  {name} t={t} rep {rep} {engine}: FAILED {res['error']}")
                        print("    " + "\n    ".join(res["stderr_tail"]))
                        continue
                    keys = ("pp128", "pp512", f"tg{tg_n}")
                    brief = " ".join(f"{k}={median(res[k]):.1f}" for k in keys)
                    print(f"  {name} t={t} rep {rep} {engine:9s} {brief} "
                          f"peak={res['peak_rss_mib']:.0f}MiB "
                          f"cpu={res['cpu_share']:.2f} ({wall:.0f}s)")  # fmt: skip
    return samples


LABELS = {"peak_rss_mib": "peak RSS", "rss_after_load_mib": "RSS loaded", "load_s": "load",
          "cpu_share": "CPU share", "tg128_raw": "tg128 llama_decode", "tg32_raw": "tg32 llama_decode"}  # fmt: skip


def summarize(
    samples: list[dict], tg_key: str, min_cpu: float
) -> tuple[list[dict], list[list[str]]]:
    """Medians per (model, threads, metric, engine) and the table rows.

    Children that got less than `min_cpu` of their cores while measuring (another process took
    them) are left out of the speed medians; they stay in the JSON, and the cell says how many
    samples were kept. Memory and load time use every child.
    """
    from _common import median

    metrics = [("pp128", "t/s"), ("pp512", "t/s"), (tg_key, "t/s"), (tg_key + "_raw", "t/s"),
               ("peak_rss_mib", "MiB"),
               ("rss_after_load_mib", "MiB"), ("load_s", "s"), ("cpu_share", "cores/thread")]  # fmt: skip
    ok = [s for s in samples if "error" not in s]
    groups = dict.fromkeys((s["model"], s["threads"]) for s in ok)
    summary, rows = [], []
    for name, t in groups:
        for key, unit in metrics:
            entry = {"model": name, "threads": t, "metric": key, "unit": unit}
            cells = []
            for engine in ("llama_cpp", "potluck"):
                mine = [
                    s for s in ok if (s["model"], s["threads"], s["engine"]) == (name, t, engine)
                ]
                mine = [s for s in mine if key in s]
                kept = [s for s in mine if unit != "t/s" or s["cpu_share"] >= min_cpu]
                vals = [v for s in kept for v in (s[key] if isinstance(s[key], list) else [s[key]])]
                entry[engine] = {"median": median(vals), "min": min(vals, default=None),
                                 "max": max(vals, default=None), "n": len(vals),
                                 "children_kept": len(kept), "children": len(mine)}  # fmt: skip
                fmt = "{:.1f}" if unit in ("t/s", "MiB") else "{:.2f}"
                cell = fmt.format(median(vals)) if vals else "—"
                if len(vals) > 1 and unit == "t/s":
                    cell += f" ({min(vals):.0f}–{max(vals):.0f})"
                if len(kept) < len(mine):
                    cell += f" [{len(kept)}/{len(mine)}]"
                cells.append(cell)
            lm, pm = entry["llama_cpp"]["median"], entry["potluck"]["median"]
            if lm is None and pm is None and not any(key in s for s in ok):
                continue  # e.g. a metric an older run did not record
            entry["ratio"] = pm / lm if lm and pm else None
            entry["paired_ratio"] = (
                _paired_ratio(ok, name, t, key, min_cpu) if unit == "t/s" else None
            )
            entry["llama_bench_ref"] = LLAMA_BENCH_REF.get((name, t), {}).get(key)
            summary.append(entry)
            ratio = f"{entry['ratio']:.2f}×" if entry["ratio"] else "—"
            paired = f"{entry['paired_ratio']:.2f}×" if entry["paired_ratio"] else ""
            rows.append([name, str(t), f"{LABELS.get(key, key)} ({unit})", *cells, ratio, paired,
                         entry["llama_bench_ref"] or ""])  # fmt: skip
    return summary, rows


HEADER = [
    "model",
    "threads",
    "metric",
    "llama.cpp",
    "potluck",
    "ratio",
    "paired",
    "llama-bench ref",
]


def _paired_ratio(ok: list[dict], name: str, t: int, key: str, min_cpu: float) -> float | None:
    """Median over reps of potluck / llama.cpp within each back-to-back pair: drift cancels."""
    from _common import median

    def one(engine: str, rep: int) -> float | None:
        for s in ok:
            same = (s["model"], s["threads"], s["engine"], s["rep"]) == (name, t, engine, rep)
            if same and key in s and s["cpu_share"] >= min_cpu:
                return median(s[key] if isinstance(s[key], list) else [s[key]])
        return None

    ratios = []
    for rep in sorted({s["rep"] for s in ok if (s["model"], s["threads"]) == (name, t)}):
        a, b = one("llama_cpp", rep), one("potluck", rep)
        if a and b:
            ratios.append(b / a)
    return median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3, help="child processes per engine (alternating)")
    ap.add_argument("--pp-inner", type=int, default=2, help="timed pp calls per child")
    ap.add_argument("--tg", type=int, default=128, help="decode steps timed per child")
    ap.add_argument("--quick", action="store_true", help="1 rep, 1 pp call, tg32: for debugging")
    ap.add_argument("--engines", default="llama_cpp,potluck")
    ap.add_argument("--min-cpu-share", type=float, default=0.0,
                    help="leave children that got less CPU than this out of the speed medians")  # fmt: skip
    ap.add_argument("--live-src", action="store_true",
                    help="children import src/ as it is at each moment, not a copy frozen at start")  # fmt: skip
    ap.add_argument("--summarize", metavar="JSON", help="re-summarize a saved run, measure nothing")
    ap.add_argument("--out", default="bench/out/single.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args.child)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import print_table, run_info, snapshot_src, write_json

    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        info, config, samples = saved["info"], saved["config"], saved["samples"]
        tg_key = f"tg{config['tg']}"
    else:
        if args.quick:
            args.reps, args.pp_inner, args.tg = 1, 1, 32
        engines = args.engines.split(",")
        info = run_info()
        if "llama_cpp" in engines and info["llama_cpp"] is None:
            print(
                "llama_cpp is not importable: skipping llama.cpp (potluck figures only, no ratios)"
            )
            engines.remove("llama_cpp")
        models = args.models.split(",")
        threads = [int(t) for t in args.threads.split(",")]
        rng = random.Random(SEED)
        tokens = [rng.randrange(*TOKEN_RANGE) for _ in range(max(*PP_SIZES, TG_PROMPT + args.tg))]
        tg_key = f"tg{args.tg}"
        print(
            f"commit {info['git_commit']}{' (+ uncommitted changes)' if info['git_dirty'] else ''} · "
            f"{info['cpu_model']} × {info['n_cpus']} · torch {info['torch']} · "
            f"llama_cpp {info['llama_cpp']} · load avg {info['loadavg_start'][0]:.2f}"
        )
        snap = None
        if "potluck" in engines and not args.live_src:
            snap, info["src_sha256"] = snapshot_src(Path(args.out).with_suffix(".src"))
            info["src_snapshot"] = str(snap)
        samples = measure(models, threads, engines, args.reps, tokens, args.tg, args.pp_inner,
                          str(snap) if snap else None)  # fmt: skip
        info["loadavg_end"] = list(os.getloadavg())
        config = {"models": models, "threads": threads, "reps": args.reps, "pp_inner": args.pp_inner,
                  "tg": args.tg, "tg_prompt": TG_PROMPT, "pp_sizes": list(PP_SIZES), "n_ctx": N_CTX,
                  "n_batch": N_BATCH, "token_seed": SEED, "token_range": list(TOKEN_RANGE),
                  "command": " ".join([Path(sys.executable).name, *sys.argv])}  # fmt: skip

    summary, rows = summarize(samples, tg_key, args.min_cpu_share)
    title = (
        "potluck vs llama.cpp: medians (min–max); ratio = potluck / llama.cpp of the medians; "
        "paired = median of per-rep ratios"
        + (
            f"; [k/n] = children with CPU share ≥ {args.min_cpu_share} kept"
            if args.min_cpu_share
            else ""
        )
    )
    print_table(title, HEADER, rows)
    out = Path(args.out)
    write_json(out, {"info": info, "config": config, "samples": samples, "summary": summary,
                     "min_cpu_share": args.min_cpu_share,
                     "table": {"header": HEADER, "rows": rows}})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
