"""Speculative decoding (issue 32): decode tok/s with and without drafts, on one machine and over
two workers with 3 ms links, on an extractive task.

    python bench/bench_spec.py [--models smollm2,gemma3] [--settings local,pool] [--reps 3]
        [--tokens 96] [--threads 2] [--delay-ms 3] [--n-max 8,16] [--quick] [--live-src]
        [--out bench/out/spec.json]

Task: three prompts (chat template applied) that ask the model to repeat, quote or lightly edit
(correct the spelling of) a given text of 60-120 words: the answer repeats its prompt, where prompt
lookup pays. Greedy, up to --tokens generated tokens, stopping at the model's end-of-generation
ids (the count is reported).

Variants per model: `none`; `ngram-simple` with --spec-draft-n-max 8 and 16; for smollm2 also
`draft-simple` with SmolLM2 itself as the draft model (the one same-vocabulary pair here: it
shows the accept path, not a speedup).

Settings:
  local  one machine: the model in one local stage on --threads threads (-t 2)
  pool   two `potluck worker -t 1`, pinned to core 0 and core 1 with taskset (when there is one),
         all layers on them (split as bench_pool.py's decode: even decode time), the head holding
         none; every connection into a worker goes through bench/delay_proxy.c (compiled with cc)
         adding --delay-ms each way, on both its ports (gRPC and data): head -> worker0, and
         worker0 -> worker1 since the plan names worker1 by its proxy's address (127.0.0.3), as
         bench_latency.py wires it; worker0 at 127.0.0.2. A draft model runs on the head, 1 thread.

Per model and setting one child process (bench/_spec_child.py) loads the model once, warms every
variant up, then runs the variants in turn, forward on even reps and backward on odd ones
(A B C D, D C B A, ...), each over every prompt. Decode tok/s = (tokens - 1) / (time from the
first token's event to the last's, taken by the caller of `Scheduler.run_one`, as `potluck run`
prints it), summed over the prompts per rep; medians over --reps. Speedup = variant / none in the
same setting (ratio of medians; `paired`: the median of each rep's own ratio). Acceptance = drafted
ids kept / drafted; steps per token = decode steps / (tokens - 1). Whether the generated ids equal
`none`'s for the same prompt (greedy: they must) is reported, not asserted. Targets (issue 32):
>= 1.8x on one machine, >= 2x over the two workers with 3 ms links. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    median,
    model_path,
    print_table,
    run_info,
    snapshot_src,
    write_json,
)

CHILD = Path(__file__).resolve().parent / "_spec_child.py"
MODELS = ("smollm2", "gemma3")
SETTINGS = ("local", "pool")
TARGETS = {"local": 1.8, "pool": 2.0}  # issue 32: speedup of drafting over none
HOSTS = ("127.0.0.2", "127.0.0.3")  # where each worker's proxies listen (loopback only)

TEXT_REPEAT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the ninety steps, lit the lamp, and watched the ships pass "
    "far below on the grey water. In winter the storms came from the north and shook the glass, "
    "but the light never failed. When the keeper grew old, his daughter learned the work, and she "
    "kept the lamp burning for another thirty years."
)  # 73 words
TEXT_QUOTE = (
    "To make bread at home, mix five hundred grams of flour with ten grams of salt and seven "
    "grams of dried yeast. Add three hundred and fifty millilitres of warm water and stir until "
    "the dough comes together. Knead it on a floured table for ten minutes, until it is smooth "
    "and springs back when pressed. Leave it in a covered bowl for an hour, shape it into a loaf, "
    "let it rise again, and bake it at two hundred and twenty degrees for thirty minutes."
)  # 85 words
TEXT_EDIT = (
    "Our village library opens at nine in the moring and closes at six in the evening. Children "
    "can borow up to five books at a time, and adults up to ten. Every Saturday a volunteer reads "
    "stories aloud in the small room behind the front desk. The library also lends board games, "
    "maps of the local walking paths, and a telescope that families can take home for a week. "
    "Please return books on time so that other readers can enjoy them too."
)  # 80 words, two misspellings ("moring", "borow")
PROMPTS = (
    f"Repeat the following text exactly, word for word:\n\n{TEXT_REPEAT}",
    "Quote the following paragraph verbatim and add nothing else:\n\n" + TEXT_QUOTE,
    "Correct the spelling mistakes in the following text and write out the whole corrected "
    f"text:\n\n{TEXT_EDIT}",
)


def variants(model: str, n_maxes: list[int], draft: bool) -> list[dict]:
    """name: the JSON's key; short: the table's label (kind/n_max)."""
    out = [{"name": "none", "short": "none", "kind": "none", "n_max": 8}]
    out += [{"name": f"ngram-simple/{k}", "short": f"ngram/{k}", "kind": "ngram-simple", "n_max": k}
            for k in n_maxes]  # fmt: skip
    if draft and model == "smollm2":  # SmolLM2 drafting for itself (the same vocabulary)
        out.append({"name": "draft-simple/8 (self)", "short": "draft/8 self",
                    "kind": "draft-simple", "n_max": 8})  # fmt: skip
    return out


# -- the pool: pinned workers behind delay proxies ---------------------------------------------------
def compile_proxy(where: Path) -> list[str]:
    """bench/delay_proxy.c compiled with cc into `where` (as bench_plan.py does); else, with a
    warning, tests/delay_proxy.py (Python: hundreds of microseconds of CPU per message)."""
    exe = where / "delay_proxy"
    source = Path(__file__).resolve().parent / "delay_proxy.c"
    try:
        done = subprocess.run(["cc", "-O2", "-o", str(exe), str(source)], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode == 0:
            return [str(exe)]
        why = done.stderr.strip()[-200:]
    except OSError as exc:
        why = str(exc)
    print(f"could not compile {source.name} ({why}): the Python proxy takes its place",
          file=sys.stderr)  # fmt: skip
    return [sys.executable, str(ROOT / "tests" / "delay_proxy.py")]


def start_worker(core: int, env: dict, log: Path) -> tuple[subprocess.Popen, int, int]:
    """`potluck worker -p 0 -t 1` on 127.0.0.1, pinned to `core` when taskset is there;
    (process, gRPC port, data port) once it listens."""
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    cmd = [*pin, sys.executable, "-m", "potluck.cli", "worker", "-p", "0", "-t", "1", "--no-mdns"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out,
                                env={**env, "POTLUCK_MDNS": "0"})  # fmt: skip
    deadline = time.monotonic() + 120
    while (
        found := re.search(r"listening on [^ ]*:(\d+) · data port (\d+)", log.read_text())
    ) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"worker did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, int(found.group(1)), int(found.group(2))


def start_proxy(cmd: list[str], host: str, port: int, delay_ms: float) -> subprocess.Popen:
    """A proxy on host:port to 127.0.0.1:port adding delay_ms each way."""
    proc = subprocess.Popen([*cmd, f"{host}:{port}", f"127.0.0.1:{port}", f"{delay_ms:g}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise SystemExit(f"the delay proxy on {host}:{port} did not start: {line}")
    return proc


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def decode_cuts(path: Path) -> list[int]:
    """[0, cut, n_layer]: the two workers' layers, even decode time by the planner's cost model
    (bench_pool.py's and bench_latency.py's split for decode)."""
    from _pool_child import balanced_cuts

    return balanced_cuts(str(path), 2, "decode")


# -- one child per model × setting --------------------------------------------------------------------
def run_child(job: dict, env: dict, log: Path) -> dict:
    """Runs the child (its progress lines go to our stderr and to `log`); its JSON result, or
    {"error": ...} with the end of what it said."""
    cmd = [sys.executable, str(CHILD), json.dumps(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    said = []
    with open(log, "w") as out:
        for line in proc.stderr:  # (stdout is one JSON line at the end: no pipe fills up)
            said.append(line)
            out.write(line)
            sys.stderr.write(line)
    stdout = proc.stdout.read() if proc.stdout else ""
    rc = proc.wait()
    lines = stdout.strip().splitlines()
    if rc != 0 or not lines:
        return {"error": f"exit {rc}: {''.join(said)[-3000:]}"}
    return json.loads(lines[-1])


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where two id lists differ (a shorter one differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(runs: list[dict], names: list[str], reps: int) -> dict:
    """Per variant: tok/s per rep (tokens - 1 and decode time summed over the prompts), medians,
    speedup over none, acceptance, steps per token, ids against none's."""
    base_ids = {r["prompt"]: r["ids"] for r in runs if r["variant"] == "none" and r["rep"] == 0}
    out: dict = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        per_rep = []
        for rep in range(reps):
            rr = [r for r in mine if r["rep"] == rep]
            toks = sum(r["n_generated"] - 1 for r in rr)
            secs = sum(r["decode_s"] for r in rr)
            per_rep.append(toks / secs if secs > 0 else None)
        per_rep_ok = [x for x in per_rep if x]
        drafted = sum(r["drafted"] for r in mine)
        kept = sum(r["draft_kept"] for r in mine)
        steps = sum(r["decode_steps"] for r in mine)
        decoded = sum(r["n_generated"] - 1 for r in mine)
        diffs = [
            {"rep": r["rep"], "prompt": r["prompt"], "at": d,
             "n": r["n_generated"], "n_none": len(base_ids.get(r["prompt"], []))}
            for r in mine
            if (d := first_diff(r["ids"], base_ids.get(r["prompt"], []))) is not None
        ]  # fmt: skip
        per_prompt = {}
        for p in sorted({r["prompt"] for r in mine}):
            pr = [r for r in mine if r["prompt"] == p]
            per_prompt[str(p)] = {
                "n_generated": sorted({r["n_generated"] for r in pr}),
                "finish": sorted({str(r["finish"]) for r in pr}),
                "tok_s_median": median([r["tok_s"] for r in pr if r["tok_s"]]),
                "acceptance": (sum(r["draft_kept"] for r in pr) / d_)
                if (d_ := sum(r["drafted"] for r in pr))
                else None,
                "steps_per_token": sum(r["decode_steps"] for r in pr)
                / max(1, sum(r["n_generated"] - 1 for r in pr)),
            }
        out[name] = {
            "tok_s_per_rep": per_rep,
            "tok_s": median(per_rep_ok),
            "tok_s_min": min(per_rep_ok) if per_rep_ok else None,
            "tok_s_max": max(per_rep_ok) if per_rep_ok else None,
            "drafted": drafted,
            "draft_kept": kept,
            "draft_steps": sum(r["draft_steps"] for r in mine),
            "follow_ups": sum(r["follow_ups"] for r in mine),
            "acceptance": kept / drafted if drafted else None,
            "decode_steps": steps,
            "steps_per_token": steps / decoded if decoded else None,
            "ms_per_step": median(
                [1e3 * r["decode_s"] / r["decode_steps"] for r in mine if r["decode_steps"]]
            ),  # fmt: skip
            "same_ids_as_none": not diffs,
            "id_diffs": diffs,
            "n_generated_per_prompt": [per_prompt[k]["n_generated"] for k in sorted(per_prompt)],
            "per_prompt": per_prompt,
        }
    none = out.get("none", {})
    for s in out.values():
        if none.get("tok_s") and s["tok_s"]:
            s["speedup"] = s["tok_s"] / none["tok_s"]
            pairs = [a / b for a, b in zip(s["tok_s_per_rep"], none["tok_s_per_rep"], strict=True)
                     if a and b]  # fmt: skip
            s["speedup_paired"] = median(pairs)
        else:
            s["speedup"] = s["speedup_paired"] = None
    return out


HEADER = ["model", "setting", "variant", "tok/s", "min–max", "× none", "target", "kept/drafted",
          "steps/tok", "drafting steps", "ms/step", "tokens", "same ids"]  # fmt: skip


def table_rows(name: str, setting: str, vs: list[dict], summary: dict) -> list[list[str]]:
    """The table's rows for one model × setting (HEADER's columns)."""
    rows = []
    target = TARGETS[setting]
    for v in vs:
        s = summary[v["name"]]
        if v["kind"] == "none":
            speed, goal = "1.00×", "–"
        elif s["speedup"] is None:
            speed, goal = "–", "–"
        else:
            speed = f"{s['speedup']:.2f}×"
            if v["kind"] == "draft-simple":
                goal = "n/a"  # SmolLM2 drafting for itself: the accept path, not a speedup
            else:
                goal = f"≥{target:g}× " + ("yes" if s["speedup"] >= target else "no")
        acc = (
            "–"
            if s["acceptance"] is None
            else (f"{100 * s['acceptance']:.0f}% {s['draft_kept']}/{s['drafted']}")
        )
        rows.append([
            name, setting, v["short"],
            "–" if s["tok_s"] is None else f"{s['tok_s']:.1f}",
            "–" if s["tok_s"] is None else f"{s['tok_s_min']:.1f}–{s['tok_s_max']:.1f}",
            speed, goal, acc,
            "–" if s["steps_per_token"] is None else f"{s['steps_per_token']:.2f}",
            f"{s['draft_steps']}/{s['decode_steps']}" if v["kind"] != "none" else "–",
            "–" if s["ms_per_step"] is None else f"{s['ms_per_step']:.1f}",
            "/".join(",".join(map(str, n)) for n in s["n_generated_per_prompt"]),
            "yes" if s["same_ids_as_none"] else f"NO ({len(s['id_diffs'])} runs)",
        ])  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="generated tokens at most per prompt")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of the local setting")
    ap.add_argument("--draft-threads", type=int, default=None,
                    help="threads of the draft model on the head (default: --threads locally, "
                         "1 in the pool)")  # fmt: skip
    ap.add_argument("--delay-ms", type=float, default=3.0, help="one-way delay per link (pool)")
    ap.add_argument("--n-max", default="8,16", help="ngram-simple's --spec-draft-n-max values")
    ap.add_argument("--no-draft", action="store_true", help="leave out draft-simple")
    ap.add_argument("--live-src", action="store_true",
                    help="import src/ as it is, not a copy frozen at the start")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/out/spec.json"))
    ap.add_argument("--quick", action="store_true",
                    help="smollm2, both settings, 1 rep, 32 tokens: a smoke test")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.models, args.reps, args.tokens = "smollm2", 1, 32
    models, settings = args.models.split(","), args.settings.split(",")
    for name in models:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"unknown setting {s!r}; choose from {', '.join(SETTINGS)}")
    n_maxes = [int(k) for k in args.n_max.split(",") if k]
    if "pool" in settings and (os.cpu_count() or 1) < 2:
        print("fewer than two cores: the pool's workers share one", file=sys.stderr)

    info = run_info()
    env = dict(os.environ)
    src_sha = None
    if not args.live_src:  # other engineers edit src/ while this runs: children import a copy
        frozen, src_sha = snapshot_src(args.out.with_suffix(".src"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(frozen), env.get("PYTHONPATH")]))
    info["src_sha256"] = src_sha
    info["potluck_from"] = env.get("PYTHONPATH") if not args.live_src else str(ROOT / "src")
    logs = args.out.parent / "spec-logs"
    logs.mkdir(parents=True, exist_ok=True)
    proxy_cmd = compile_proxy(logs) if "pool" in settings else []
    result: dict = {
        "info": info,
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args) | {"out": str(args.out)},
        "prompts": list(PROMPTS),
        "targets": TARGETS,
        "timing": "decode tok/s = (tokens - 1) / (last token's event - first token's event), "
        "taken by the caller of Scheduler.run_one; per rep summed over the prompts",
        "proxy": proxy_cmd,
        "results": {},
    }
    rows = []
    t_all = time.perf_counter()
    for name in models:
        path = model_path(name)
        vs = variants(name, n_maxes, not args.no_draft)
        for setting in settings:
            print(f"== {name} · {setting}", file=sys.stderr, flush=True)
            job = {
                "model": str(path), "setting": setting, "threads": args.threads,
                "assignments": [], "draft": str(path), "n_ctx": 1024, "tokens": args.tokens,
                "reps": args.reps, "prompts": list(PROMPTS), "variants": vs,
                "draft_threads": args.draft_threads or (args.threads if setting == "local" else 1),
            }  # fmt: skip
            procs: list[subprocess.Popen] = []
            entry: dict = {"loadavg_before": list(os.getloadavg())}
            t0 = time.perf_counter()
            try:
                if setting == "pool":
                    job["threads"] = 1  # the head holds no layers
                    workers = [start_worker(core, env, logs / f"{name}-w{core}.log")
                               for core in (0, 1)]  # fmt: skip
                    procs += [w for w, _, _ in workers]
                    for host, (_, port, data) in zip(HOSTS, workers, strict=True):
                        procs += [start_proxy(proxy_cmd, host, p, args.delay_ms)
                                  for p in (port, data)]  # fmt: skip
                    cuts = decode_cuts(path)
                    job["assignments"] = [
                        [f"{host}:{port}", a, b]
                        for host, (_, port, _), a, b in zip(HOSTS, workers, cuts[:-1], cuts[1:], strict=True)
                    ]  # fmt: skip
                    entry |= {"cuts": cuts, "delay_ms": args.delay_ms}
                got = run_child(job, env, logs / f"{name}-{setting}.log")
            finally:
                stop(procs)
            entry |= {"wall_s": time.perf_counter() - t0, "loadavg_after": list(os.getloadavg()),
                      "job": {k: v for k, v in job.items() if k != "prompts"}}  # fmt: skip
            if "error" in got:
                print(f"{name} · {setting} failed: {got['error']}", file=sys.stderr)
                entry["error"] = got["error"]
                result["results"][f"{name}/{setting}"] = entry
                rows.append([name, setting, "ERROR", *["–"] * (len(HEADER) - 3)])
                continue
            summary = summarize(got["runs"], [v["name"] for v in vs], args.reps)
            entry |= {"load_s": got["load_s"], "runs": got["runs"], "summary": summary}
            result["results"][f"{name}/{setting}"] = entry
            rows += table_rows(name, setting, vs, summary)
    # greedy ids of none: one machine against the pool
    for name in models:
        loc, pool = (result["results"].get(f"{name}/{s}", {}) for s in ("local", "pool"))
        if "runs" in loc and "runs" in pool:
            a = {r["prompt"]: r["ids"] for r in loc["runs"] if r["variant"] == "none"}
            b = {r["prompt"]: r["ids"] for r in pool["runs"] if r["variant"] == "none"}
            result["results"][f"{name}/none_local_vs_pool"] = {
                str(p): first_diff(a[p], b[p]) for p in a if p in b
            }
    result["wall_s"] = time.perf_counter() - t_all
    result["table"] = {"header": HEADER, "rows": rows}
    delay = f"{args.delay_ms:g} ms" if "pool" in settings else ""
    print_table(
        f"speculative decoding, extractive task ({len(PROMPTS)} prompts, greedy, ≤ {args.tokens} "
        f"tokens) · {info['cpu_model']} · local -t {args.threads}; pool: 2 workers -t 1, head "
        f"without layers, links +{delay} each way · decode tok/s, medians of {args.reps}",
        HEADER,
        rows,
        width=170,
    )
    for key, entry in result["results"].items():
        for vname, s in entry.get("summary", {}).items():
            if s["id_diffs"]:
                where = sorted({(d["prompt"], d["at"]) for d in s["id_diffs"]})
                reps = len({d["rep"] for d in s["id_diffs"]})
                print(f"{key} {vname}: ids differ from none's: "
                      + ", ".join(f"prompt {p} from token {at}" for p, at in where)
                      + f" ({reps} of {args.reps} reps)")  # fmt: skip
    for name in models:
        d = result["results"].get(f"{name}/none_local_vs_pool")
        if d is not None:
            same = all(v is None for v in d.values())
            print(f"{name}: none's ids, local vs pool: " + ("identical" if same else f"differ {d}"))
    write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
