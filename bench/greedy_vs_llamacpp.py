"""Correctness against llama.cpp's own C++ tools on the real models: greedy tokens and perplexity.

Greedy: for each prompt (raw completion), `llama-completion -p PROMPT -n N --temp 0 --top-k 1
-no-cnv --no-warmup --prompt-cache FILE --prompt-cache-all`; the session file it saves at the end
holds every token id of the run (prompt + generated), so llama.cpp's tokens are compared as ids,
not as re-tokenized text. Potluck's `generate(..., Sampler(GREEDY))` runs on llama.cpp's own
prompt ids (whether potluck's tokenizer gives the same ids is reported too). Each stops at its
end-of-generation ids or after --n tokens. At the first divergence, potluck's logits after the
common prefix give its top-2 gap and its margin between its pick and llama.cpp's (the tools print
no logits: a margin near 0 is a near-tie that rounding flips; a large one is a real difference).

Perplexity: `llama-perplexity -f TEXT -c CTX --kl-divergence-base FILE`: its "Final estimate",
and the log-probabilities of every scored position with the token ids it used (the file). Potluck:
`perplexity(model, text, ctx)` on its own tokenization, and the same method on llama.cpp's ids,
whose log-probabilities give the mean KL divergence (llama.cpp ‖ potluck) and how often the two
agree on the top token, as `llama-perplexity --kl-divergence` reports them.

    python bench/greedy_vs_llamacpp.py [--models smollm2,gemma3] [--n 48] [--ctx 256] [--quick]
                                       [--threads 2] [--llama-bin DIR] [--out bench/out/greedy.json]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    llama_bin_default,
    llama_tools,
    markdown_table,
    model_path,
    print_table,
    run_info,
    write_json,
)

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
TEXT = Path(__file__).resolve().parent / "data" / "prose.txt"
N_CTX = 1024  # both engines' context for the greedy runs
TIMEOUT_S = 900
SESSION_MAGIC = 0x6767736E  # "ggsn": llama.cpp's LLAMA_SESSION_MAGIC
KL_MAGIC = b"_logits_"  # llama-perplexity's --kl-divergence-base file


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{Path(cmd[0]).name} exit {done.returncode}:\n{tail}")
    return done


# -- llama.cpp side --------------------------------------------------------------------------------
def session_tokens(path: Path) -> list[int]:
    """The token ids in a llama.cpp session file: u32 magic, u32 version, u32 n, i32 ids[n], ..."""
    with open(path, "rb") as f:
        magic, _version, n = np.frombuffer(f.read(12), np.uint32)
        if magic != SESSION_MAGIC:
            raise RuntimeError(f"{path} is not a llama.cpp session file (magic {magic:#x})")
        return np.frombuffer(f.read(4 * int(n)), np.int32).tolist()


def llama_greedy(
    bin_dir: Path, path: Path, prompt: str, n: int, threads: int
) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) of one llama-completion run."""
    with tempfile.TemporaryDirectory() as tmp:
        session = Path(tmp) / "session.bin"  # must not exist: it would be loaded
        done = _run([str(bin_dir / "llama-completion"), "-m", str(path), "-p", prompt,
                     "-n", str(n), "--temp", "0", "--top-k", "1", "-no-cnv", "--no-warmup",
                     "--verbose-prompt", "-c", str(N_CTX), "-t", str(threads),
                     "--prompt-cache", str(session), "--prompt-cache-all"])  # fmt: skip
        found = re.search(r"number of tokens in prompt = (\d+)", done.stderr)
        if found is None:
            raise RuntimeError("llama-completion did not say its prompt length (--verbose-prompt)")
        ids = session_tokens(session)
    k = int(found.group(1))
    return ids[:k], ids[k:]


def llama_perplexity(
    bin_dir: Path, path: Path, text_file: Path, n_ctx: int, threads: int, kl_file: Path
) -> float | None:
    """llama-perplexity's final PPL; its log-probabilities go to kl_file."""
    done = _run([str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text_file),
                 "-c", str(n_ctx), "-t", str(threads), "--kl-divergence-base", str(kl_file)])  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    return float(found.group(1)) if found else None


class KLBase:
    """llama-perplexity's --kl-divergence-base file: "_logits_", i32 n_ctx, n_vocab, n_chunk,
    i32 tokens[n_chunk * n_ctx], then per chunk one row per scored position j in
    [n_ctx/2, n_ctx - 1): f32 scale, f32 min_log_prob, u16 q[n_vocab] (padded to even), where
    log p = min_log_prob + scale * q (q = 0: at most min_log_prob, 16 below the top logit)."""

    def __init__(self, path: Path) -> None:
        head = np.fromfile(path, np.uint8, count=20)
        if head[:8].tobytes() != KL_MAGIC:
            raise RuntimeError(f"{path} is not a llama-perplexity logits file")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(x) for x in head[8:20].view(np.int32))
        n_tok = self.n_ctx * self.n_chunk
        self.tokens = np.fromfile(path, np.int32, count=n_tok, offset=20)
        self.first = self.n_ctx // 2
        self.n_rows = self.n_ctx - 1 - self.first
        nv = 2 * ((self.n_vocab + 1) // 2) + 4
        shape = (self.n_chunk, self.n_rows, nv)
        self.rows = np.memmap(path, np.uint16, "r", offset=20 + 4 * n_tok, shape=shape)

    def log_probs(self, chunk: int) -> np.ndarray:
        """[n_rows, n_vocab] float64 log-probabilities of one chunk's scored positions."""
        raw = np.asarray(self.rows[chunk])
        head = raw[:, :4].copy().view(np.float32)  # [n_rows, 2]: scale, min_log_prob
        q = raw[:, 4 : 4 + self.n_vocab].astype(np.float64)
        return head[:, 1:2].astype(np.float64) + head[:, 0:1].astype(np.float64) * q


# -- potluck side ----------------------------------------------------------------------------------
def top2(row: np.ndarray) -> tuple[int, int, float]:
    """(best id, runner-up id, best logit - runner-up logit) of a [V] logit row."""
    i2 = np.argpartition(row, -2)[-2:]
    a, b = (int(i2[1]), int(i2[0])) if row[i2[1]] >= row[i2[0]] else (int(i2[0]), int(i2[1]))
    return a, b, float(row[a] - row[b])


def potluck_logits(m, ids: list[int]) -> np.ndarray:
    """Logits [V] after `ids`, one forward from an empty cache (ids fit one batch here)."""
    from potluck.model.stage import SeqChunk

    seq = m.new_seq_id()
    try:
        return m.pipeline.forward(np.array(ids, np.int64), [SeqChunk(seq, len(ids))])[-1]
    finally:
        m.pipeline.drop(seq)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def compare_on_llama_ids(m, base: KLBase) -> dict:
    """Potluck on llama-perplexity's own chunks (its ids, BOS first when the model uses one):
    PPL of the second half of each chunk, KL(llama.cpp ‖ potluck) per position over llama.cpp's
    tokens with log p > -16 (as llama-perplexity --kl-divergence), and top-1 agreement."""
    from potluck.model.stage import SeqChunk

    tok = m.tokenizer
    nll, kld, same_top, count = 0.0, [], 0, 0
    for c in range(base.n_chunk):
        chunk = base.tokens[c * base.n_ctx : (c + 1) * base.n_ctx].astype(np.int64)
        if tok.add_bos:
            chunk[0] = tok.bos_id
        seq = m.new_seq_id()
        try:
            parts = []
            for i in range(0, base.n_ctx, 512):
                part = chunk[i : i + 512]
                rows = np.arange(len(part))
                parts.append(m.pipeline.forward(part, [SeqChunk(seq, len(part))], rows))
        finally:
            m.pipeline.drop(seq)
        ours = log_softmax(np.concatenate(parts)[base.first : base.n_ctx - 1])  # [n_rows, V]
        theirs = base.log_probs(c)
        targets = chunk[base.first + 1 : base.n_ctx]
        nll -= float(ours[np.arange(len(targets)), targets].sum())
        keep = theirs > -16.0
        p = np.where(keep, np.exp(theirs), 0.0)
        kld += (p * np.where(keep, theirs - ours, 0.0)).sum(axis=1).tolist()
        same_top += int((ours.argmax(axis=1) == theirs.argmax(axis=1)).sum())
        count += len(targets)
    return {"ppl": math.exp(nll / count), "mean_kld": float(np.mean(kld)),
            "max_kld": float(np.max(kld)), "same_top1": same_top / count, "n_scored": count}  # fmt: skip


def run_model(name: str, args, bin_dir: Path, text: str, prompts: tuple[str, ...]) -> dict:
    from potluck.engine.generate import generate
    from potluck.engine.perplexity import perplexity
    from potluck.model.stage import Compute
    from potluck.pool.build import load_model
    from potluck.sampling import GREEDY, Sampler

    path = model_path(name)
    m = load_model(path, n_ctx=N_CTX, compute=Compute(threads=args.threads))
    tok = m.tokenizer
    res: dict = {"model": name, "path": str(path), "stop_ids": sorted(tok.eot_ids), "prompts": []}
    for prompt in prompts:
        t0 = time.perf_counter()
        ids, theirs = llama_greedy(bin_dir, path, prompt, args.n, args.threads)
        t_theirs = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = list(generate(m, ids, args.n, Sampler(GREEDY)))  # on llama.cpp's prompt ids
        t_ours = time.perf_counter() - t0
        div = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        entry = {
            "prompt": prompt, "ids": ids, "potluck_ids": tok.encode(prompt),
            "potluck_tokens": ours, "llama_tokens": theirs,
            "potluck_text": tok.decode(ours), "llama_text": tok.decode(theirs),
            "first_divergence": div, "n_compared": min(len(ours), len(theirs)),
            "potluck_s": t_ours, "llama_s": t_theirs,
        }  # fmt: skip
        entry["tokenizer_ids_match"] = entry["potluck_ids"] == ids
        if div is not None:
            mine = potluck_logits(m, ids + theirs[:div])
            pa, pb, gap = top2(mine)
            entry["at_divergence"] = {
                "potluck_top2": [pa, pb], "potluck_top2_gap": gap,
                "potluck_pick_minus_llama_pick": float(mine[ours[div]] - mine[theirs[div]]),
                "tokens": {"llama": tok.decode([theirs[div]]), "potluck": tok.decode([ours[div]])},
            }  # fmt: skip
        res["prompts"].append(entry)
        print(f"  {name} {prompt!r}: first divergence {div} of {entry['n_compared']}"
              f" (lengths {len(ours)} / {len(theirs)})")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "text.txt"
        text_file.write_text(text)
        kl_file = Path(tmp) / "llama_logprobs.bin"
        t0 = time.perf_counter()
        llama_ppl = llama_perplexity(bin_dir, path, text_file, args.ctx, args.threads, kl_file)
        t_theirs = time.perf_counter() - t0
        base = KLBase(kl_file)
        t0 = time.perf_counter()
        own = perplexity(m, text, args.ctx)
        t_ours = time.perf_counter() - t0
        same = compare_on_llama_ids(m, base)
        ids = tok.encode(text, add_bos=tok.add_bos, parse_special=False)
        ids_match = ids[: len(base.tokens)] == base.tokens.tolist()
    res["perplexity"] = {
        "n_ctx": args.ctx, "text": TEXT.name, "text_chars": len(text), "n_tokens": len(ids),
        "tokenizer_ids_match": ids_match, "potluck": own.ppl, "potluck_chunks": own.n_chunks,
        "potluck_scored": own.n_scored, "potluck_running": list(own.chunk_ppl),
        "potluck_on_llama_ids": same["ppl"], "llama_cpp": llama_ppl, "llama_chunks": base.n_chunk,
        "llama_scored": same["n_scored"], "mean_kld": same["mean_kld"], "max_kld": same["max_kld"],
        "same_top1": same["same_top1"],
        "ratio": same["ppl"] / llama_ppl if llama_ppl else None,
        "potluck_s": t_ours, "llama_s": t_theirs,
    }  # fmt: skip
    print(f"  {name} perplexity: potluck {own.ppl:.4f} (on llama.cpp's ids {same['ppl']:.4f}) "
          f"llama.cpp {llama_ppl}  ({base.n_chunk} chunks) · mean KLD {same['mean_kld']:.5f} · "
          f"same top-1 {100 * same['same_top1']:.1f} %")  # fmt: skip
    m.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--n", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity chunk length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", type=Path, default=llama_bin_default(),
                    help="llama.cpp's build/bin (default: $LLAMA_CPP_BIN, else the vendored build)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 tokens, 2 chunks")
    ap.add_argument("--out", default="bench/out/greedy.json")
    args = ap.parse_args()
    bin_dir = llama_tools(args.llama_bin, "llama-completion", "llama-perplexity")
    if bin_dir is None:
        raise SystemExit("nothing to compare against without llama.cpp's tools")
    info = run_info(bin_dir, "llama-completion")
    text, prompts = TEXT.read_text(), PROMPTS
    if args.quick:  # ≈ 2.6 chunks of English: llama-perplexity wants at least two
        args.n, prompts, text = 16, PROMPTS[:1], text[: 2 * args.ctx * 6]
    print(f"commit {info['git_commit']}{' (+ uncommitted changes)' if info['git_dirty'] else ''} · "
          f"{info['ggml']} · llama.cpp {info['llama_cpp']}")  # fmt: skip
    results = [run_model(name, args, bin_dir, text, prompts) for name in args.models.split(",")]

    g_header = ["model", "prompt", "same ids", "first divergence",
                "potluck there: its pick − llama.cpp's / its top-2 gap", "potluck continuation"]  # fmt: skip
    g_rows = []
    for r in results:
        for p in r["prompts"]:
            d, at = p["first_divergence"], p.get("at_divergence")
            g_rows.append([
                r["model"], repr(p["prompt"]), "yes" if p["tokenizer_ids_match"] else "NO",
                f"none in {p['n_compared']}" if d is None else f"{d} of {p['n_compared']}",
                f"{at['potluck_pick_minus_llama_pick']:.3f} / {at['potluck_top2_gap']:.3f}"
                if at else "—",
                repr(p["potluck_text"][:40]),
            ])  # fmt: skip
    p_header = ["model", "n_ctx", "chunks", "same ids", "potluck ppl", "on llama.cpp's ids",
                "llama.cpp ppl", "ratio", "mean KLD", "same top-1"]  # fmt: skip
    p_rows = [[r["model"], str(q["n_ctx"]), f"{q['potluck_chunks']} / {q['llama_chunks']}",
               "yes" if q["tokenizer_ids_match"] else "NO", f"{q['potluck']:.4f}",
               f"{q['potluck_on_llama_ids']:.4f}",
               f"{q['llama_cpp']:.4f}" if q["llama_cpp"] else "—",
               f"{q['ratio']:.4f}" if q["ratio"] else "—", f"{q['mean_kld']:.5f}",
               f"{100 * q['same_top1']:.1f} %"]
              for r in results for q in [r["perplexity"]]]  # fmt: skip
    print_table(
        "greedy tokens: potluck vs llama-completion on llama.cpp's prompt ids", g_header, g_rows
    )
    print_table(f"perplexity on {TEXT.name} (llama-perplexity's method; ratio and KLD on its ids)",
                p_header, p_rows)  # fmt: skip
    config = {"models": args.models.split(","), "n": args.n, "ctx": args.ctx, "threads": args.threads,
              "quick": args.quick, "llama_bin": str(bin_dir),
              "command": " ".join([Path(sys.executable).name, *sys.argv])}  # fmt: skip
    out = Path(args.out)
    write_json(out, {"info": info, "config": config, "results": results,
                     "markdown": {"greedy": markdown_table(g_header, g_rows),
                                  "perplexity": markdown_table(p_header, p_rows)}})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
