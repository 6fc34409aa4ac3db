"""Constrained decoding's cost (issue 31): the grammar's token mask per step against a SmolLM2
decode step, on one machine.

    python bench/bench_grammar.py [--model smollm2] [--threads 2] [--reps 3] [--tokens 96]
        [--out bench/out/grammar.json]

Three grammars: a JSON schema (an array of objects: strings, a bounded integer, an enum), any
JSON object (response_format json_object), and a forced tool call (two tools, the Hermes format
the fallback uses). For each: greedy decode through the scheduler (`Scheduler.run_one`, as
`potluck run` decodes) with and without the grammar on the same prompt, decode ms per token =
(time from the first token's event to the last's) / (tokens - 1), median over --reps, runs
interleaved (plain, constrained, plain, ...); and the mask alone: the same answer's tokens replayed
through `Constraint.apply` + `accept` (what the sampler adds per token), median µs per token.
The target (BENCHMARKS.md): mask ≤ 10 % of a SmolLM2 decode step.

--engines: also the grammar engines side by side on the same answers: llguidance (what Potluck
uses) and xgrammar (vLLM's other engine; measured only where it is importable: `pip install
xgrammar`, not a dependency) — compile ms per grammar, mask µs per token (median, p90).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_local, model_path, print_table, run_info, write_json  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["engineer", "doctor", "artist", "pilot"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "maximum": 10000},
                    "b": {"type": "integer", "maximum": 10000},
                },
                "required": ["a", "b"],
            },
        },
    },
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("bench/out/grammar.json"))
    ap.add_argument("--engines", action="store_true", help="compare grammar engines too")
    args = ap.parse_args()

    from potluck.api.chat import ChatTurn, prepare
    from potluck.engine.requests import Request, TokenEvent
    from potluck.engine.scheduler import Scheduler, SchedulerConfig
    from potluck.grammar import Constraint, Vocabulary, json_object_grammar, json_schema_grammar
    from potluck.sampling import SamplingParams

    m = load_local(str(model_path(args.model)), 2048, args.threads)
    tok = m.tokenizer
    vocab = Vocabulary.of(tok)
    sched = Scheduler(m, SchedulerConfig(), inline=True)

    def ids_of(text: str, **turn: object) -> tuple[list[int], str | None]:
        p = prepare(ChatTurn([{"role": "user", "content": text}], **turn), m.chat, tok)  # type: ignore[arg-type]
        return p.ids, p.grammar

    cases = {
        "json_schema": (ids_of("List four people with their age and job.")[0], json_schema_grammar(SCHEMA)),
        "json_object": (ids_of('Reply with a JSON object with keys "name" and "color".')[0], json_object_grammar()),
        "tool call": ids_of("What is the weather in Paris?", tools=TOOLS, tool_choice="required"),
    }  # fmt: skip

    def decode(ids: list[int], grammar: str | None) -> tuple[float, list[int]]:
        req = Request(
            tuple(ids), SamplingParams(temperature=0.0, grammar=grammar), args.tokens, tok.eot_ids
        )
        times, out = [], []
        for ev in sched.run_one(req):
            if isinstance(ev, TokenEvent):
                times.append(time.perf_counter())
                out.append(int(ev.token))
        return (times[-1] - times[0]) / max(1, len(times) - 1) * 1e3, out

    rows, results = [], {}
    answers: dict[str, tuple[str, list[int]]] = {}
    for name, (ids, grammar) in cases.items():
        assert grammar is not None
        decode(ids, grammar)  # warm-up
        plain_ms, constrained_ms = [], []
        answer: list[int] = []
        for _ in range(args.reps):
            plain_ms.append(decode(ids, None)[0])
            ms, answer = decode(ids, grammar)
            constrained_ms.append(ms)
        answers[name] = (grammar, answer)
        mask_us = []
        logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
        for _ in range(args.reps):
            c = Constraint(vocab, grammar, 0)
            for t in answer:
                t0 = time.perf_counter()
                c.apply(logits)
                if t in tok.eot_ids:
                    break
                c.accept(t)
                mask_us.append((time.perf_counter() - t0) * 1e6)
        p, q, k = (
            statistics.median(plain_ms),
            statistics.median(constrained_ms),
            statistics.median(mask_us),
        )
        results[name] = {
            "answer_tokens": len(answer),
            "decode_ms_plain": p,
            "decode_ms_constrained": q,
            "mask_us_median": k,
            "mask_us_p90": float(np.percentile(mask_us, 90)),
            "mask_share_of_step": k / 1e3 / p,
        }
        rows.append(
            [name, str(len(answer)), f"{p:.2f}", f"{q:.2f}", f"{q / p:.2f}×", f"{k:.0f}",
             f"{np.percentile(mask_us, 90):.0f}", f"{100 * k / 1e3 / p:.1f} %"]
        )  # fmt: skip
    sched.close()
    if args.engines:
        results["engines"] = _engines(tok, answers, args.reps)
    print_table(
        f"grammar mask vs decode step ({args.model}, -t {args.threads}, greedy, medians of {args.reps})",
        ["grammar", "tokens", "plain ms/tok", "constrained ms/tok", "ratio", "mask µs",
         "mask µs p90", "mask / step"],
        rows,
    )  # fmt: skip
    write_json(
        args.out,
        {"info": run_info(), "args": vars(args) | {"out": str(args.out)}, "results": results},
    )


def _engines(tok: object, answers: dict[str, tuple[str, list[int]]], reps: int) -> dict:
    """llguidance and (where importable) xgrammar on the same answers: compile ms, mask µs per
    token. xgrammar takes the same schema (the tool-call grammar is llguidance's Lark: skipped)."""
    import json as _json

    import llguidance
    import llguidance.numpy as lnp

    from potluck.grammar import Vocabulary

    vocab = Vocabulary.of(tok)  # type: ignore[arg-type]
    n = tok.vocab_size  # type: ignore[attr-defined]
    eot = sorted(tok.eot_ids)  # type: ignore[attr-defined]
    schemas = {"json_schema": SCHEMA, "json_object": {"type": "object"}}
    out: dict = {}
    rows = []
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo(
            [tok.token_bytes(i) for i in range(n)],
            stop_token_ids=eot,  # type: ignore[attr-defined]
        )
        compiler = xgr.GrammarCompiler(info)
    except ImportError:
        xgr = None
    for name, (grammar, answer) in answers.items():
        ids = [t for t in answer if t not in eot]

        def run_llg(grammar: str = grammar, ids: list[int] = ids) -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
            c_ms = (time.perf_counter() - t0) * 1e3
            mask = lnp.allocate_token_bitmask(1, n)
            us = []
            for t in ids:
                t1 = time.perf_counter()
                lnp.fill_next_token_bitmask(m, mask)
                us.append((time.perf_counter() - t1) * 1e6)
                m.consume_token(t)
            return c_ms, us

        engines = {"llguidance": run_llg}
        if xgr is not None and name in schemas:

            def run_xgr(
                schema: dict = schemas[name], ids: list[int] = ids
            ) -> tuple[float, list[float]]:
                t0 = time.perf_counter()
                compiled = compiler.compile_json_schema(
                    _json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
                )
                m = xgr.GrammarMatcher(compiled)
                c_ms = (time.perf_counter() - t0) * 1e3
                mask = xgr.allocate_token_bitmask(1, n)
                us = []
                for t in ids:
                    t1 = time.perf_counter()
                    m.fill_next_token_bitmask(mask)
                    us.append((time.perf_counter() - t1) * 1e6)
                    assert m.accept_token(t), "xgrammar refused the answer's token"
                return c_ms, us

            engines["xgrammar"] = run_xgr
        for engine, run in engines.items():
            comp, masks = [], []
            for _ in range(reps):
                c_ms, us = run()
                comp.append(c_ms)
                masks += us
            res = {"compile_ms": statistics.median(comp), "mask_us": statistics.median(masks),
                   "mask_us_p90": float(np.percentile(masks, 90))}  # fmt: skip
            out.setdefault(name, {})[engine] = res
            rows.append([name, engine, f"{res['compile_ms']:.1f}", f"{res['mask_us']:.0f}",
                         f"{res['mask_us_p90']:.0f}"])  # fmt: skip
    print_table(
        "grammar engines on the same answers (compile: first use, on this vocabulary)",
        ["grammar", "engine", "compile ms", "mask µs", "mask µs p90"],
        rows,
    )
    return out


if __name__ == "__main__":
    main()
