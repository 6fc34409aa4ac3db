"""Time to first token over a multi-turn chat that re-sends its whole history (issue 32).

    python bench/bench_chat.py [--models gemma3[,PATH|NAME...]] [--turns 10] [--reps 1]
                               [--max-tokens 48] [--threads 2] [--ctx 4096]
                               [--servers potluck,potluck-nocache,llama] [--llama-bin DIR]
                               [--llama-template auto|model] [--no-warmup] [--quick]
                               [--out bench/out/chat_<model>.json]

A chat UI sends the whole conversation with every turn. Per model and server under test, one
server is started on a free loopback port and one conversation of `--turns` turns is run against
it: each turn appends the next of a fixed list of user messages (deterministic, ~50–65 words each,
so every turn adds about as many tokens as the one before), POSTs the whole history to
/v1/chat/completions (stream, temperature 0, `--max-tokens`, `stream_options.include_usage`),
times the first content delta (TTFT: request sent → first non-empty `delta.content`) and the
whole answer, and appends the answer's text to the history as the assistant's turn.

Servers (one at a time, each stopped before the next starts; all with the same `-t` and `-c`):
  potluck          `potluck serve -m MODEL -t T -c C` (its prompt cache on: the default)
  potluck-nocache  the same with `--cache-ram 0` (prefix cache off); skipped, with a note, while
                   `potluck serve --help` does not list the flag
  llama            llama.cpp's `llama-server -m MODEL -t T -c C --parallel 1` (it caches prompts by
                   default), from `--llama-bin`, $LLAMA_CPP_BIN or the vendored build; when the
                   GGUF has no chat template (Gemma-3-270M's has none) and potluck uses its
                   built-in one, llama-server gets `--no-jinja --chat-template NAME`, llama.cpp's
                   built-in of that name, so that both render the same prompt (`--llama-template
                   model`: llama-server's own fallback, ChatML, instead)

Reported per turn: prompt tokens (`usage.prompt_tokens`), the cached tokens each server says it
reused (`usage.prompt_tokens_details.cached_tokens`; llama-server also sends `timings.cache_n`,
kept raw in the JSON), TTFT and total time. Summary: last-turn TTFT / second-turn TTFT per server
(issue 32's target for potluck with the cache: ≤ 1.3), potluck's last-turn TTFT / llama-server's
(target ≤ 1.5), and whether potluck's greedy answers with the cache on and off were the same on
every turn. `--reps R` runs R conversations per server, each on a fresh server, the servers in
alternating order, and reports per-turn medians. Prints a table, writes JSON
(bench/out/chat_<model>.json); never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    MODEL_NAMES,
    ROOT,
    SYNTHETIC,
    llama_bin_default,
    llama_tools,
    median,
    model_path,
    print_table,
    run_info,
    write_json,
)

SERVERS = ("potluck", "potluck-nocache", "llama")
TARGET_LAST_OVER_SECOND = 1.3  # potluck with the cache: last-turn TTFT / second-turn TTFT
TARGET_VS_LLAMA = 1.5  # potluck with the cache, last turn: TTFT / llama-server's
# mDNS off and no API key: only this script talks to the servers, on loopback
ENV = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"} | {"POTLUCK_MDNS": "0"}

# The user's side of the conversation: varied topics, 50–65 words each, so that every turn adds
# about as many tokens as the previous one did. Turn i sends USER_MESSAGES[i % len].
USER_MESSAGES = (
    "Hi! I am planning a small vegetable garden behind my house this spring. The plot gets about "
    "six hours of direct sun, the soil is heavy clay, and I have never grown anything before. "
    "Which three vegetables would you suggest for a complete beginner, and what should I do to "
    "the soil before planting them?",
    "Thanks, that helps. Now a different question about the same garden: my neighbour keeps "
    "chickens and offered me a few bags of their manure. Is it safe to dig it straight into the "
    "beds a couple of weeks before planting, or does it need to be composted first? Please "
    "explain briefly why, and how long the composting usually takes.",
    "Let us switch topics for a moment. I am learning Python and I keep confusing lists, tuples "
    "and sets. Could you describe in plain words when each one is the right choice, and give me "
    "one short everyday example for each, like a shopping list or the coordinates of a point? "
    "Keep it simple, I am still a beginner at programming.",
    "Great. Here is a small problem I am stuck on: I have a list of temperatures recorded every "
    "hour for a week, and I want the highest and lowest value of each day, plus the average. "
    "Describe the steps you would take, in order, without writing the full program, so that I "
    "can try to write the code on my own first.",
    "Back to everyday life. My sister is visiting next weekend with her two children, aged six "
    "and nine. It will probably rain on Saturday. Can you suggest a few indoor activities we "
    "could do at home that do not need expensive equipment, and one simple recipe that the kids "
    "could help to cook for lunch without much danger?",
    "The children loved the idea of baking. One of them is allergic to eggs, though. How can I "
    "replace eggs in a simple cake or a batch of muffins, and does the replacement change the "
    "baking time or the texture much? If there are several options, tell me which one you would "
    "try first and why you prefer it.",
    "Now something completely different: I want to start running again after two years without "
    "any exercise. I am forty, a little overweight, and my knees sometimes ache on stairs. What "
    "would a sensible plan for the first month look like, how many times a week should I run, "
    "and what warning signs should make me stop?",
    "I tried your plan for a week and it went well, but I get bored running the same loop around "
    "the park every time. Do you have ideas to keep it interesting, for example games, music, "
    "routes or small goals? Also, is it worth buying a fitness watch at this stage, or is a "
    "phone app good enough for a beginner?",
    "A question about history, for my nephew's school project: why did the Roman Empire in the "
    "West fall, while the Eastern part lasted for almost another thousand years? He needs a short "
    "explanation that a twelve year old can understand, with two or three main reasons and no "
    "more than a few simple sentences for each one of them.",
    "His teacher also asked for one interesting fact about daily life in ancient Rome that most "
    "people do not know. Could you give me three candidates, for example about food, baths, "
    "schools or entertainment, and say for each one how sure historians are about it, so that "
    "he does not present a myth as a fact in class?",
    "Last topic for today, I promise. I would like to read more books this year but I always "
    "fall asleep after a few pages in the evening. Do you have practical tips for building a "
    "reading habit, and could you suggest a mix of five novels and non-fiction books that are "
    "gripping enough to keep a tired person awake?",
    "Thank you for all of this. Before I go, could you summarise our whole conversation in a few "
    "short bullet points, one for each topic we discussed, so that I can copy them into my "
    "notebook? Please keep the order in which we talked about things and mention the single most "
    "useful piece of advice for each topic that came up.",
)
WARMUP_MESSAGE = "Say hello in five words."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def potluck_has_flag(flag: str) -> bool:
    """Whether `potluck serve --help` lists `flag` (wide columns: rich would wrap a narrow one)."""
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "serve", "--help"],
        capture_output=True, text=True, timeout=120, env=ENV | {"COLUMNS": "250"},
    )  # fmt: skip
    return flag in done.stdout + done.stderr


def potluck_builtin_template(path: Path) -> str | None:
    """The name of potluck's built-in chat template for this file ("gemma", "chatml", "llama2"),
    or None when it uses the file's own."""
    from potluck.modelfile.chat import ChatTemplate
    from potluck.modelfile.gguf_file import GGUFFile

    name = ChatTemplate.from_metadata(GGUFFile(path).metadata).name
    return name.removeprefix("built-in ") if name.startswith("built-in ") else None


def server_command(kind: str, path: Path, port: int, args: argparse.Namespace) -> list[str]:
    common = ["-m", str(path), "-t", str(args.threads), "-c", str(args.ctx)]
    if kind == "llama":
        cmd = [str(args.llama_bin / "llama-server"), *common, "--parallel", "1",
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        builtin = potluck_builtin_template(path) if args.llama_template == "auto" else None
        if builtin:  # with --jinja (its default) a name given to --chat-template is template text
            cmd += ["--no-jinja", "--chat-template", builtin]
        return cmd
    cmd = [sys.executable, "-m", "potluck.cli", "serve", *common, "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    if kind == "potluck-nocache":
        cmd += ["--cache-ram", "0"]
    return cmd


def stop(proc: subprocess.Popen) -> None:
    """Terminate, then kill after 20 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> str:
    """Poll GET /health until 200 (llama-server answers 503 while it loads); the model's id from
    /v1/models."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
                return str(data[0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; log {log}")


def chat_turn(client: Any, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, total time, the answer text and what the server
    reported (usage, llama-server's timings)."""
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    parts: list[str] = []
    usage: dict | None = None
    timings: dict | None = None
    finish = None
    first_chunk = first_content = None
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:2000]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            first_chunk = first_chunk or now
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"error in the stream: {ev['error']}")
            for ch in ev.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    first_content = first_content or now
                    parts.append(text)
                finish = ch.get("finish_reason") or finish
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    t1 = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft_s": first_content - t0 if first_content else None,
        "first_chunk_s": first_chunk - t0 if first_chunk else None,
        "total_s": t1 - t0,
        "answer": "".join(parts),
        "finish_reason": finish,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "usage": usage,
        "timings": timings,
    }


def run_conversation(kind: str, path: Path, label: str, rep: int, args: argparse.Namespace) -> dict:
    import httpx

    port = free_port()
    cmd = server_command(kind, path, port, args)
    url = f"http://127.0.0.1:{port}"
    log = args.log_dir / f"chat_{label}_{kind}{f'_rep{rep}' if args.reps > 1 else ''}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = ENV | {"OMP_NUM_THREADS": str(args.threads)}
    reps = f" · rep {rep + 1}/{args.reps}" if args.reps > 1 else ""
    print(f"{label} · {kind}{reps}: {shlex.join(cmd)}", flush=True)
    turns: list[dict] = []
    t_start = time.perf_counter()
    with log.open("w") as logf:
        # the log goes to a file: a pipe nobody reads would fill and stall a chatty server
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        model_id = wait_ready(proc, url, log)
        load_s = time.perf_counter() - t_start
        with httpx.Client(timeout=httpx.Timeout(900, connect=30)) as client:
            warmup = None
            if not args.no_warmup:  # one short unrelated exchange: first-request costs out
                w = [{"role": "user", "content": WARMUP_MESSAGE}]
                warmup = chat_turn(client, url, model_id, w, 4)
            messages: list[dict] = []
            for i in range(args.turns):
                messages.append({"role": "user", "content": USER_MESSAGES[i % len(USER_MESSAGES)]})
                load_before = os.getloadavg()[0]
                r = chat_turn(client, url, model_id, messages, args.max_tokens)
                r |= {"turn": i + 1, "messages": len(messages), "loadavg_1m_before": load_before}
                turns.append(r)
                messages.append({"role": "assistant", "content": r["answer"]})
                ttft = f"{r['ttft_s'] * 1e3:.0f} ms" if r["ttft_s"] is not None else "-"
                print(f"  turn {i + 1}: prompt {r['prompt_tokens']} · cached "
                      f"{r['cached_tokens']} · TTFT {ttft} · total {r['total_s']:.2f} s · "
                      f"{r['completion_tokens']} tokens · load {load_before:.2f}",
                      flush=True)  # fmt: skip
    finally:
        stop(proc)
    return {"server": kind, "command": cmd, "model_id": model_id, "load_s": load_s,
            "warmup": warmup, "turns": turns, "log": str(log)}  # fmt: skip


def aggregate(kind: str, runs: list[dict]) -> dict:
    """A server's conversations (one per rep, each on a fresh server) → per turn: the medians of
    TTFT and total time, every sample, and the first run's token counts and answer."""
    turns = []
    for i in range(min(len(r["turns"]) for r in runs)):
        ts = [r["turns"][i] for r in runs]
        ttfts = [t["ttft_s"] for t in ts if t["ttft_s"] is not None]
        turns.append({
            "turn": i + 1,
            "prompt_tokens": ts[0]["prompt_tokens"],
            "cached_tokens": ts[0]["cached_tokens"],
            "ttft_s": median(ttfts),
            "total_s": median([t["total_s"] for t in ts]),
            "ttft_s_all": [t["ttft_s"] for t in ts],
            "total_s_all": [t["total_s"] for t in ts],
            "cached_tokens_all": [t["cached_tokens"] for t in ts],
            "answers": [t["answer"] for t in ts],
        })  # fmt: skip
    return {"server": kind, "reps": len(runs), "turns": turns}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ttft_of(res: dict | None, turn: int) -> float | None:
    """TTFT of 1-based `turn` (negative: from the end)."""
    if res is None or not res["turns"] or len(res["turns"]) < abs(turn):
        return None
    return res["turns"][turn - 1 if turn > 0 else turn]["ttft_s"]


def summarize(results: dict[str, dict], n_turns: int) -> dict:
    per_server = {}
    for kind, res in results.items():
        second, last = ttft_of(res, 2), ttft_of(res, -1)
        per_server[kind] = {"second_turn_ttft_s": second, "last_turn_ttft_s": last,
                            "last_over_second": ratio(last, second)}  # fmt: skip
    pot, nocache, llama = (results.get(k) for k in SERVERS)
    same = None
    first_diff = None
    if pot and nocache:
        pairs = list(zip(pot["turns"], nocache["turns"], strict=False))
        same_turns = [a["answers"] == b["answers"] for a, b in pairs]
        same = all(same_turns) and len(pairs) == n_turns
        first_diff = next((i + 1 for i, s in enumerate(same_turns) if not s), None)
    vs_llama = None
    if pot and llama:
        pairs = list(zip(pot["turns"], llama["turns"], strict=False))
        vs_llama = [a["answers"] == b["answers"] for a, b in pairs]
    return {
        "per_server": per_server,
        "potluck_llama_same_answer_per_turn": vs_llama,
        "potluck_last_over_second": per_server.get("potluck", {}).get("last_over_second"),
        "target_last_over_second": TARGET_LAST_OVER_SECOND,
        "potluck_last_over_llama_last": ratio(ttft_of(pot, -1), ttft_of(llama, -1)),
        "target_vs_llama": TARGET_VS_LLAMA,
        "cache_on_off_same_answers": same,
        "cache_on_off_first_different_turn": first_diff,
    }


def fmt_ms(s: float | None) -> str:
    return f"{s * 1e3:.0f}" if s is not None else "-"


def fmt_x(x: float | None, target: float | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}×" + (f" (target ≤ {target})" if target else "")


def print_tables(label: str, path: Path, results: dict[str, dict], summary: dict,
                 args: argparse.Namespace) -> None:  # fmt: skip
    kinds = list(results)
    short = {"potluck": "potluck", "potluck-nocache": "no cache", "llama": "llama"}
    # short words: rich wraps a header at spaces but cuts a long word with an ellipsis
    header = ["turn", "prompt tokens"]
    for k in kinds:
        header += [f"{short[k]} cached", f"{short[k]} TTFT ms", f"{short[k]} total s"]
    both = "potluck" in results and "potluck-nocache" in results
    if both:
        header.append("same answer on / off")
    rows = []
    for i in range(args.turns):
        got = {k: results[k]["turns"][i] for k in kinds if i < len(results[k]["turns"])}
        prompts = list(dict.fromkeys(str(t["prompt_tokens"]) for t in got.values()))
        row = [str(i + 1), " / ".join(prompts) if prompts else "-"]  # one value when all agree
        for k in kinds:
            t = got.get(k)
            row += ([str(t["cached_tokens"]), fmt_ms(t["ttft_s"]), f"{t['total_s']:.2f}"]
                    if t else ["-", "-", "-"])  # fmt: skip
        if both:
            a, b = got.get("potluck"), got.get("potluck-nocache")
            row.append("-" if a is None or b is None else
                       "yes" if a["answers"] == b["answers"] else "NO")  # fmt: skip
        rows.append(row)
    reps = f" · medians of {args.reps} conversations" if args.reps > 1 else ""
    print_table(f"{args.turns}-turn chat (issue 32) · {path.name} · "
                f"{args.max_tokens} tokens per answer · -t {args.threads} · -c {args.ctx}{reps}",
                header, rows)  # fmt: skip
    srows = []
    for k in kinds:
        s = summary["per_server"][k]
        target = TARGET_LAST_OVER_SECOND if k == "potluck" else None
        srows.append([f"{k}: last / second turn TTFT",
                      f"{fmt_ms(s['last_turn_ttft_s'])} / {fmt_ms(s['second_turn_ttft_s'])} ms",
                      fmt_x(s["last_over_second"], target)])  # fmt: skip
    if "potluck" in results and "llama" in results:
        srows.append(["potluck / llama-server, last-turn TTFT",
                      f"{fmt_ms(ttft_of(results['potluck'], -1))} / "
                      f"{fmt_ms(ttft_of(results['llama'], -1))} ms",
                      fmt_x(summary["potluck_last_over_llama_last"], TARGET_VS_LLAMA)])  # fmt: skip
    same = summary["cache_on_off_same_answers"]
    srows.append(["potluck greedy answers, cache on = off on every turn",
                  "-" if same is None else ("yes" if same else
                                            f"NO (first at turn "
                                            f"{summary['cache_on_off_first_different_turn']})"),
                  ""])  # fmt: skip
    vs = summary["potluck_llama_same_answer_per_turn"]
    if vs is not None:
        srows.append(["potluck (cache) = llama-server answer, turns",
                      f"{sum(vs)} of {len(vs)}", ""])  # fmt: skip
    print_table(f"summary · {path.name}", ["", "TTFT", "ratio"], srows)


def resolve_model(spec: str) -> tuple[str, Path]:
    """(label, path) for a name _common knows or a GGUF path."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p.stem, p.resolve()
    if spec in (*MODEL_NAMES, *SYNTHETIC):
        return spec, model_path(spec)
    raise SystemExit(f"{spec!r} is neither a file nor a model name "
                     f"({', '.join(dict.fromkeys((*MODEL_NAMES, *SYNTHETIC)))})")  # fmt: skip


def main() -> None:
    # SIGTERM (timeout, kill) as Ctrl-C: the finally blocks stop the server that is running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--models", default="gemma3", help="names bench/_common.py knows, or GGUF paths"
    )
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reps", type=int, default=1,
                    help="conversations per server, each on a fresh server, in alternating "
                         "order (A B C, C B A, ...); the table gives medians")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"some of {','.join(SERVERS)}")
    ap.add_argument("--llama-bin", "--llamacpp-bin", type=Path, default=llama_bin_default())
    ap.add_argument("--llama-template", choices=("auto", "model"), default="auto",
                    help="auto: llama-server renders potluck's built-in template when the file has "
                         "none; model: llama-server's own choice")  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true",
                    help="no short unrelated exchange before the conversation")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default bench/out/chat_<model>.json; with several models "
                         "<stem>_<model>.json)")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="gemma3, 3 turns, 16 tokens per answer: a smoke test")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.models, args.turns, args.max_tokens = "gemma3", 3, 16
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    notes: list[str] = []
    if "potluck-nocache" in servers and not potluck_has_flag("--cache-ram"):
        note = ("potluck-nocache skipped: `potluck serve` has no --cache-ram flag yet (the prefix "
                "cache cannot be turned off)")  # fmt: skip
        print(note)
        notes.append(note)
        servers.remove("potluck-nocache")
    llama_bin = None
    if "llama" in servers:
        llama_bin = llama_tools(args.llama_bin, "llama-server")
        if llama_bin is None:
            notes.append(f"llama skipped: no llama-server in {args.llama_bin}")
            servers.remove("llama")
    if not servers:
        raise SystemExit("nothing to measure")
    args.log_dir = ROOT / "bench" / "out"
    info = run_info(llama_bin, "llama-server")
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        lscpu = None
    models = [resolve_model(m) for m in args.models.split(",") if m]
    for label, path in models:
        runs: dict[str, list[dict]] = {k: [] for k in servers}
        errors: dict[str, list[str]] = {}
        for r in range(args.reps):
            for kind in servers if r % 2 == 0 else servers[::-1]:
                try:
                    runs[kind].append(run_conversation(kind, path, label, r, args) | {"rep": r})
                except Exception as e:  # noqa: BLE001 - one server's failure: keep the others
                    print(f"  {kind} failed: {e}")
                    errors.setdefault(kind, []).append(f"rep {r}: {type(e).__name__}: {e}")
        results = {k: aggregate(k, rs) for k, rs in runs.items() if rs}
        summary = summarize(results, args.turns)
        if results:
            print_tables(label, path, results, summary, args)
        if args.out is None:
            out = ROOT / "bench" / "out" / f"chat_{label}.json"
        elif len(models) == 1:
            out = args.out
        else:
            out = args.out.with_name(f"{args.out.stem}_{label}{args.out.suffix}")
        info_now = info | {"loadavg_end": list(os.getloadavg())}
        write_json(out, {
            "info": info_now,
            "lscpu": lscpu,
            "command": shlex.join([sys.executable, *sys.argv]),
            "args": {k: str(v) for k, v in vars(args).items()},
            "model": {"label": label, "path": str(path)},
            "user_messages": list(USER_MESSAGES),
            "warmup_message": None if args.no_warmup else WARMUP_MESSAGE,
            "notes": notes,
            "errors": errors,
            "runs": runs,
            "per_turn": results,
            "summary": summary,
        })  # fmt: skip
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
