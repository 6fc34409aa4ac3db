"""Correctness against llama.cpp on the real models: greedy tokens and perplexity.

Greedy: for each prompt (raw completion), potluck's `generate(..., Sampler(GREEDY))` vs an
eval/argmax loop in llama-cpp-python on the *same* token ids (potluck's tokenizer; whether
llama.cpp's tokenizer gives the same ids is reported too). Both stop at the model's end-of-turn ids
or after --n tokens. At the first divergence we report llama.cpp's top-2 logit gap there (a near-tie
flips on rounding noise; a large gap is a real bug) and potluck's view of the same two tokens.

Perplexity: potluck's `perplexity(model, text, n_ctx)` and the same method computed from llama.cpp's
logits (chunks of n_ctx tokens, BOS first when the model uses one, second half of each chunk scored).

    python bench/greedy_vs_llamacpp.py [--models smollm2,gemma3] [--n 48] [--ctx 256] [--quick]
                                       [--threads 2] [--out bench/out/greedy.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown_table, model_path, print_table, run_info, write_json  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
TEXT = Path(__file__).resolve().parent / "data" / "prose.txt"


def top2(row: np.ndarray) -> tuple[int, int, float]:
    """(best id, runner-up id, best logit - runner-up logit) of a [V] logit row."""
    i2 = np.argpartition(row, -2)[-2:]
    a, b = (int(i2[1]), int(i2[0])) if row[i2[1]] >= row[i2[0]] else (int(i2[0]), int(i2[1]))
    return a, b, float(row[a] - row[b])


def llama_greedy(
    llm, ids: list[int], n: int, stop: frozenset[int]
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logit row each was picked from (llm built with logits_all=True)."""
    llm.reset()
    llm.eval(ids)
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tok = int(np.argmax(row))
        out.append(tok)
        rows.append(row)
        if tok in stop or llm.n_tokens + 1 >= llm.n_ctx():
            break
        llm.eval([tok])
    return out, rows


def potluck_logits(m, ids: list[int]) -> np.ndarray:
    """Logits [V] after `ids`, one forward from an empty cache (ids fit one batch here)."""
    from potluck.model.stage import SeqChunk

    seq = m.new_seq_id()
    try:
        out = m.pipeline.forward(torch.tensor(ids), [SeqChunk(seq, len(ids))])
        return out[-1].float().numpy()
    finally:
        m.pipeline.drop(seq)


def llama_perplexity(llm, ids: list[int], n_ctx: int, bos: int | None) -> tuple[float, int, int]:
    """llama-perplexity's method on llama.cpp's logits: (ppl, n_chunks, n_scored)."""
    first, total, count = n_ctx // 2, 0.0, 0
    n_chunks = len(ids) // n_ctx
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx : (c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[first : n_ctx - 1], dtype=np.float64)  # [n_ctx-1-first, V]
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        targets = np.array(chunk[first + 1 : n_ctx])
        total += float((lse - logits[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return math.exp(total / count), n_chunks, count


def run_model(name: str, args, text: str, prompts: tuple[str, ...]) -> dict:
    import llama_cpp

    from potluck.engine.generate import generate, load_model
    from potluck.engine.perplexity import perplexity
    from potluck.engine.sampling import GREEDY, Sampler

    path = model_path(name)
    m = load_model(path, n_ctx=1024)
    llm = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, logits_all=True, verbose=False)  # fmt: skip
    tok = m.tokenizer
    stop = tok.eot_ids
    res: dict = {"model": name, "path": str(path), "stop_ids": sorted(stop), "prompts": []}
    for prompt in prompts:
        ids = tok.encode(prompt)
        ids_llama = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ours = list(generate(m, ids, args.n, Sampler(GREEDY)))
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs, rows = llama_greedy(llm, ids, args.n, stop)
        t_theirs = time.perf_counter() - t0
        div = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if div is None and len(ours) != len(theirs):
            div = min(len(ours), len(theirs))
        with torch.inference_mode():
            first_row = potluck_logits(m, ids)
        entry = {
            "prompt": prompt, "ids": ids, "tokenizer_ids_match": list(ids_llama) == list(ids),
            "llama_ids": list(ids_llama), "potluck_tokens": ours, "llama_tokens": theirs,
            "potluck_text": tok.decode(ours), "llama_text": tok.decode(theirs),
            "first_divergence": div, "n_compared": min(len(ours), len(theirs)),
            "prompt_logits_max_abs_diff": float(np.abs(first_row - rows[0]).max()),
            "prompt_logits_llama_abs_max": float(np.abs(rows[0]).max()),
            "potluck_s": t_ours, "llama_s": t_theirs,
        }  # fmt: skip
        if div is not None and div < min(len(ours), len(theirs)):
            a, b, gap = top2(rows[div])
            with torch.inference_mode():
                mine = potluck_logits(m, ids + theirs[:div])
            pa, pb, pgap = top2(mine)
            entry["at_divergence"] = {
                "llama_top2": [a, b], "llama_top2_gap": gap,
                "llama_pick_minus_potluck_pick_in_llama": float(rows[div][theirs[div]] - rows[div][ours[div]]),
                "potluck_top2": [pa, pb], "potluck_top2_gap": pgap,
                "potluck_pick_minus_llama_pick_in_potluck": float(mine[ours[div]] - mine[theirs[div]]),
                "tokens": [tok.decode([theirs[div]]), tok.decode([ours[div]])],
            }  # fmt: skip
        res["prompts"].append(entry)
        print(f"  {name} {prompt!r}: first divergence {div} of {entry['n_compared']}; "
              f"prompt logits max |Δ| {entry['prompt_logits_max_abs_diff']:.3f}")  # fmt: skip

    t0 = time.perf_counter()
    with torch.inference_mode():
        ours = perplexity(m, text, args.ctx)
    t_ours = time.perf_counter() - t0
    ids = tok.encode(text, add_bos=tok.add_bos, parse_special=False)
    ids_llama = llm.tokenize(text.encode(), add_bos=tok.add_bos, special=False)
    t0 = time.perf_counter()
    ppl, n_chunks, n_scored = llama_perplexity(
        llm, ids, args.ctx, tok.bos_id if tok.add_bos else None
    )
    t_theirs = time.perf_counter() - t0
    res["perplexity"] = {
        "n_ctx": args.ctx, "text": str(TEXT.relative_to(Path.cwd()) if TEXT.is_relative_to(Path.cwd()) else TEXT),
        "text_chars": len(text), "n_tokens": len(ids), "tokenizer_ids_match": list(ids_llama) == list(ids),
        "potluck": ours.ppl, "potluck_chunks": ours.n_chunks, "potluck_scored": ours.n_scored,
        "potluck_running": list(ours.chunk_ppl), "llama_cpp": ppl, "llama_chunks": n_chunks,
        "llama_scored": n_scored, "ratio": ours.ppl / ppl, "potluck_s": t_ours, "llama_s": t_theirs,
    }  # fmt: skip
    print(f"  {name} perplexity: potluck {ours.ppl:.4f}  llama.cpp {ppl:.4f}  ({n_chunks} chunks)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--n", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--ctx", type=int, default=256, help="perplexity chunk length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 tokens, 2 chunks")
    ap.add_argument("--out", default="bench/out/greedy.json")
    args = ap.parse_args()
    info = run_info()
    if info["llama_cpp"] is None:
        raise SystemExit(
            "llama_cpp is not importable: nothing to compare against (pip install llama-cpp-python)"
        )
    torch.set_num_threads(args.threads)
    text, prompts = TEXT.read_text(), PROMPTS
    if args.quick:
        args.n, prompts, text = 16, PROMPTS[:1], text[: 2 * args.ctx * 5]  # ≈ 2 chunks of English
    print(f"commit {info['git_commit']}{' (+ uncommitted changes)' if info['git_dirty'] else ''} · "
          f"torch {info['torch']} · llama_cpp {info['llama_cpp']}")  # fmt: skip
    results = [run_model(name, args, text, prompts) for name in args.models.split(",")]

    g_header = ["model", "prompt", "same ids", "first divergence",
                "top-2 gap there: llama.cpp / potluck (other way)",
                "prompt logits max |Δ|", "potluck continuation"]  # fmt: skip
    g_rows = []
    for r in results:
        for p in r["prompts"]:
            d = p["first_divergence"]
            at = p.get("at_divergence")
            g_rows.append([
                r["model"], repr(p["prompt"]), "yes" if p["tokenizer_ids_match"] else "NO",
                f"none in {p['n_compared']}" if d is None else f"{d} of {p['n_compared']}",
                f"{at['llama_top2_gap']:.3f} / {at['potluck_pick_minus_llama_pick_in_potluck']:.3f}"
                if at else "—",
                f"{p['prompt_logits_max_abs_diff']:.3f} (of {p['prompt_logits_llama_abs_max']:.1f})",
                repr(p["potluck_text"][:40]),
            ])  # fmt: skip
    p_header = [
        "model",
        "n_ctx",
        "chunks",
        "scored",
        "same ids",
        "potluck ppl",
        "llama.cpp ppl",
        "ratio",
    ]
    p_rows = [[r["model"], str(q["n_ctx"]), str(q["potluck_chunks"]), str(q["potluck_scored"]),
               "yes" if q["tokenizer_ids_match"] else "NO", f"{q['potluck']:.4f}",
               f"{q['llama_cpp']:.4f}", f"{q['ratio']:.4f}"]
              for r in results for q in [r["perplexity"]]]  # fmt: skip
    print_table("greedy tokens: potluck vs llama.cpp on the same ids", g_header, g_rows)
    print_table(f"perplexity on {TEXT.name} (llama-perplexity's method)", p_header, p_rows)
    config = {"models": args.models.split(","), "n": args.n, "ctx": args.ctx, "threads": args.threads,
              "quick": args.quick, "command": " ".join([Path(sys.executable).name, *sys.argv])}  # fmt: skip
    out = Path(args.out)
    write_json(out, {"info": info, "config": config, "results": results,
                     "markdown": {"greedy": markdown_table(g_header, g_rows),
                                  "perplexity": markdown_table(p_header, p_rows)}})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
