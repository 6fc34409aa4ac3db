"""The planner's prediction against the measurement: `potluck plan`'s tok/s vs `potluck bench`'s.

    python bench/bench_plan.py [--models smollm2,qwen7b] [--setups pair,head] [--reps 2]
        [-p 64] [-n 32] [--out bench/out/plan.json]

Setups (workers are `potluck worker -t 1` processes, each pinned to one core with `taskset`,
standing in for two single-core machines):
  pair     over loopback; the head holds no layers (--mem 0): the best single machine is one
           worker, the pool is the two workers (BENCHMARKS.md's "two single-core workers vs one")
  head     over loopback; the head takes part: `potluck bench -t 1` pinned to core 0 and one
           worker pinned to core 1, a pool of two single-core machines of which the head is one
  gbit     as pair, each machine a network namespace on a 1 Gbit/s link (tc tbf; needs root)
  fasteth  as pair on 100 Mbit/s links
  gbit-1ms, gbit-3ms, fasteth-5ms
           as gbit or fasteth, every worker behind a proxy that delays each byte 1, 3 or 5 ms
           each way, on both of its ports (gRPC, and the data port that hidden states take);
           the proxy is bench/delay_proxy.c (compiled with cc), else tests/delay_proxy.py
Each run is `potluck bench --json` (the planner's figures for the pool and the best single
machine, then both measured, in one process); the table shows predicted / measured for each and
whether the two verdicts agree. Target (issue 15): within 15 %. Never asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, median, model_path, print_table, run_info, write_json  # noqa: E402

SETUPS = ("pair", "head", "gbit", "fasteth", "gbit-1ms", "gbit-3ms", "fasteth-5ms")
NETNS = {
    "gbit": ("1gbit", 0.0),
    "fasteth": ("100mbit", 0.0),
    "gbit-1ms": ("1gbit", 1.0),
    "gbit-3ms": ("1gbit", 3.0),
    "fasteth-5ms": ("100mbit", 5.0),
}
SECRET = "bench-plan-pool-secret-0123456789"
TESTS = Path(__file__).resolve().parent.parent / "tests"


def _wait(log: Path, pattern: str, proc: subprocess.Popen, what: str) -> re.Match[str]:
    deadline = time.monotonic() + 120
    while (found := re.search(pattern, log.read_text())) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{what} did not start: {log.read_text()}")
        time.sleep(0.2)
    return found


def _worker_cmd(core: int, model_dir: Path, host: str) -> list[str]:
    return [
        "taskset", "-c", str(core), sys.executable, "-m", "potluck.cli", "worker", "-H", host,
        "-p", "0" if host == "127.0.0.1" else "50052", "-t", "1", "--no-mdns",
        "--model-dir", str(model_dir),
    ]  # fmt: skip


def _bench_cmd(model: Path, peers: list[str], setup: str, n_prompt: int, n_predict: int):
    cmd = [sys.executable, "-m", "potluck.cli", "bench", "-m", str(model), "--no-mdns", "--json"]
    cmd += ["-p", str(n_prompt), "-n", str(n_predict)]
    cmd += [a for p in peers for a in ("--peer", p)]
    if setup == "head":  # the head is the pool's first single-core machine
        return ["taskset", "-c", "0", *cmd, "-t", "1"]
    return cmd + ["--mem", "0"]


def _report(done: subprocess.CompletedProcess) -> dict:
    if done.returncode != 0:
        raise SystemExit(f"potluck bench failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def _delay_proxy(logs: Path) -> list[str]:
    """The delay proxy's command: bench/delay_proxy.c, compiled here (microseconds of CPU per
    message), else tests/delay_proxy.py (Python: hundreds, taken from the two cores the workers
    compute on)."""
    exe = logs / "delay_proxy"
    source = Path(__file__).resolve().parent / "delay_proxy.c"
    try:
        done = subprocess.run(
            ["cc", "-O2", "-o", str(exe), str(source)], capture_output=True, text=True
        )
        if done.returncode == 0:
            return [str(exe)]
        why = done.stderr.strip()[-200:]
    except OSError as exc:  # no C compiler
        why = str(exc)
    print(
        f"could not compile {source.name} ({why}): the Python proxy takes its place",
        file=sys.stderr,
    )
    return [sys.executable, str(TESTS / "delay_proxy.py")]


@contextlib.contextmanager
def pool(setup: str, model_dir: Path, logs: Path) -> Iterator[Callable[[list[str]], dict]]:
    """Two pinned workers for `setup`; yields run(bench command) -> its JSON report, with the
    workers' addresses already in the command."""
    if setup not in NETNS:
        procs = []
        try:
            peers = []
            for core in (1,) if setup == "head" else (0, 1):  # head: core 0 is the head's
                log = logs / f"w{core}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen(
                        _worker_cmd(core, model_dir, "127.0.0.1"),
                        stdout=subprocess.DEVNULL, stderr=out,
                    )  # fmt: skip
                procs.append(proc)
                port = _wait(log, r"listening on [^ ]*:(\d+) ", proc, "worker").group(1)
                peers.append(f"127.0.0.1:{port}")
            yield lambda cmd: _report(subprocess.run(
                cmd + [a for p in peers for a in ("--peer", p)],
                capture_output=True, text=True, timeout=1800,
            ))  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
        return
    sys.path.insert(0, str(TESTS))
    from netns import netns_lan  # noqa: PLC0415 (root and `ip netns` only for these setups)

    rate, delay_ms = NETNS[setup]
    proxy_cmd = _delay_proxy(logs) if delay_ms else []
    env = {**os.environ, "POTLUCK_SECRET": SECRET, "POTLUCK_MDNS": "0"}
    with netns_lan(3, rate=rate) as (head, *hosts):
        peers = []
        for core, host in enumerate(hosts):
            log = logs / f"w{core}-{setup}.log"
            listen = "127.0.0.1" if delay_ms else host.ip
            with open(log, "w") as out:
                proc = host.popen(
                    _worker_cmd(core, model_dir, listen), env=env,
                    stdout=subprocess.DEVNULL, stderr=out,
                )  # fmt: skip
            found = _wait(log, r"listening on [^ ]*:(\d+) · data port (\d+)", proc, "worker")
            port, data_port = found.group(1), found.group(2)
            if delay_ms:  # both of its ports behind a delay: gRPC on 6000, the data port as is
                for name, listen, target in (("", 6000, port), ("-data", data_port, data_port)):
                    plog = logs / f"proxy{core}{name}-{setup}.log"
                    with open(plog, "w") as out:
                        proxy = host.popen(
                            [*proxy_cmd, f"{host.ip}:{listen}", f"127.0.0.1:{target}", str(delay_ms)],
                            stdout=out, stderr=subprocess.STDOUT,
                        )  # fmt: skip
                    _wait(plog, "ready", proxy, "delay proxy")
                peers.append(f"{host.ip}:6000")
            else:
                peers.append(f"{host.ip}:{port}")
        yield lambda cmd: _report(head.run(
            cmd + [a for p in peers for a in ("--peer", p)], env=env, timeout=1800, check=False,
        ))  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    """Medians over repetitions: predicted and measured tok/s of the pool and the best single."""

    def measured(label_pool: bool) -> list[float]:
        return [
            r["decode_tokens_per_s"]
            for run in runs
            for r in run["measured"]
            if (r["label"] == "pool") == label_pool
        ]

    pred_pool = median([r["predicted"]["pool_tokens_per_s"] for r in runs])
    singles = [r["predicted"]["best_single"] for r in runs if r["predicted"]["best_single"]]
    pred_single = median([s["tokens_per_s"] for s in singles]) if singles else None
    return {
        "predicted_pool": pred_pool,
        "measured_pool": median(measured(True)),
        "predicted_single": pred_single,
        "measured_single": median(measured(False)) if measured(False) else None,
        "predicted_worth_it": [r["predicted"]["worth_it"] for r in runs],
        "measured_worth_it": [r["measured_worth_it"] for r in runs],
    }


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen7b")
    ap.add_argument("--setups", default="pair,head")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/out/plan.json"))
    args = ap.parse_args()
    models = args.models.split(",")
    setups = args.setups.split(",")
    for name in models:
        if name not in MODEL_NAMES:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")
    for s in setups:
        if s not in SETUPS:
            raise SystemExit(f"unknown setup {s!r}; choose from {', '.join(SETUPS)}")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores (one per pinned worker)")
    info = run_info()
    results: dict[str, dict] = {}
    logs = args.out.parent / "plan-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in models:
        path = model_path(name)
        for setup in setups:
            with pool(setup, path.parent, logs) as run:
                runs = []
                for rep in range(args.reps):
                    print(f"{name} · {setup} · run {rep + 1}/{args.reps}", file=sys.stderr)
                    runs.append(run(_bench_cmd(path, [], setup, args.n_prompt, args.n_predict)))
                results[f"{name}/{setup}"] = {"runs": runs, **summarize(runs)}
    rows = []
    for key, r in results.items():
        agree = all(
            m is None or p == m
            for p, m in zip(r["predicted_worth_it"], r["measured_worth_it"], strict=True)
        )
        rows.append([
            key,
            f"{r['predicted_single'] or 0:.2f} / {r['measured_single'] or 0:.2f}",
            _ratio(r["predicted_single"], r["measured_single"]),
            f"{r['predicted_pool']:.2f} / {r['measured_pool']:.2f}",
            _ratio(r["predicted_pool"], r["measured_pool"]),
            "yes" if agree else "NO",
        ])  # fmt: skip
    print_table(
        f"planned vs measured decode tok/s · {info['cpu_model']} · -p {args.n_prompt} "
        f"-n {args.n_predict} · medians of {args.reps}",
        ["model/setup", "single: planned / measured", "ratio", "pool: planned / measured",
         "ratio", "verdicts agree"],
        rows,
    )  # fmt: skip
    write_json(args.out, {"info": info, "args": vars(args) | {"out": str(args.out)}, **results})
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
