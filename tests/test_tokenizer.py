"""Tokenizer and chat template, checked id-for-id against `transformers`' GGUF tokenizers."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import pytest
from gguf import Keys, TokenType

from potluck.errors import ModelFileError, UnsupportedError
from potluck.modelfile.chat import ChatTemplate, ChatTemplateError
from potluck.modelfile.gguf_file import GGUFFile
from potluck.modelfile.tokenizer import PRE_TOKENIZER_SPLITS, StreamDecoder, Tokenizer

K = Keys.Tokenizer

CORPUS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces    inside     here",
    " ",
    "   ",
    " " * 31 + "thirty-one spaces (Gemma's longest space token)",
    "\n",
    "line one\nline two\n\nline four\n\n\n",
    "tabs\tand\t\ttabs\t\t\t end\t",
    "\r\nwindows\r\nline\r\n",
    "  \n  \n\t \n x",
    'def add(a, b):\n    """Add two numbers."""\n    if a > b:\n        return a + b\n'
    "    return b  # done\n\n\nclass Foo:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; } // C++",
    "x = {'key': [1, 2, 3], \"other\": None}",
    "It's they're we've I'm you'll he'd DON'T",
    "Café naïve résumé Ångström façade coöperate",
    "Straße, Œuvre, ñandú, Ελληνικά, русский, العربية, עברית, हिन्दी",
    "日本語のテキストです。中文也可以。한국어 텍스트",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️🔥",
    "𝕳𝖊𝖑𝖑𝖔 𝑥² + 𝑦² = 𝑧²",
    "\u200bzero width\ufeff BOM\u00a0nbsp",
    "3.14159265358979 and 1234567890123456789 and 1,000,000 and 007",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "mixed<|im_end|>in <end_of_turn> side<eos>",
    "<bos>starts with bos",
    "a" * 300,
]

STREAM_TEXTS = [
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 done",
    "日本語のテキストです。中文也可以。",
    "Café 𝕳𝖊𝖑𝖑𝖔 €100",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, object]:
    """(ours, transformers' reference) for one real model; each built once per module."""
    return request.getfixturevalue(f"{request.param}_pair")


def _reference(path: Path) -> object:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path: Path) -> tuple[Tokenizer, object]:
    return Tokenizer.from_gguf(smollm2_path), _reference(smollm2_path)


@pytest.fixture(scope="module")
def gemma3_pair(gemma3_path: Path) -> tuple[Tokenizer, object]:
    return Tokenizer.from_gguf(gemma3_path), _reference(gemma3_path)


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_reference(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, ref = pair
    assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", ["Hello world", "", "<|im_start|>user\nhi"])
def test_bos_rule_matches_reference(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, ref = pair
    assert ours.encode(text) == ref.encode(text)


def test_parse_special_off_reads_control_tokens_as_text(pair: tuple[Tokenizer, object]) -> None:
    ours, ref = pair
    text = "<|im_start|>user<|im_end|><start_of_turn>model<end_of_turn>"
    plain = ours.encode(text, add_bos=False, parse_special=False)
    assert not set(plain) & {ours.eos_id, *ours.eot_ids}
    assert plain == ref.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert ours.decode(plain) == text


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, _ = pair
    assert ours.decode(ours.encode(text, add_bos=False)) == text
    with_bos = ours.encode(text, add_bos=True, parse_special=False)
    assert ours.decode(with_bos, skip_special=True) == text


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_emits_whole_characters(pair: tuple[Tokenizer, object], text: str) -> None:
    ours, ref = pair
    ids = ours.encode(text, add_bos=False)
    stream = StreamDecoder(ours)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == ours.decode(ids) == text
    assert ref.decode(ids) == text
    assert len(pieces) > len([p for p in pieces if p])  # some ids were held back mid-character


def test_stream_decoder_flushes_an_unfinished_character(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    ids = ours.encode("\U00013000", add_bos=False)  # a hieroglyph neither vocabulary has whole
    assert [ours.token_bytes(i) for i in ids] == [b"\xf0", b"\x93", b"\x80", b"\x80"]
    stream = StreamDecoder(ours)
    assert [stream.push(i) for i in ids[:3]] == ["", "", ""]
    assert stream.flush() == "\ufffd"


def test_gemma3_long_space_runs_follow_llamacpp(gemma3_pair: tuple[Tokenizer, object]) -> None:
    """Known divergence: `transformers` BPE-merges Gemma's space-run tokens (40 spaces -> 16 + 24),
    while SentencePiece and llama.cpp match user-defined tokens longest first (31 + 9). We follow
    llama.cpp; runs of up to 31 spaces agree (see CORPUS)."""
    tok, _ = gemma3_pair
    ids = tok.encode(" " * 40 + "x", add_bos=False)
    assert [tok.token_text(i) for i in ids] == [" " * 31, " " * 9, "x"]


def test_special_ids_smollm2(smollm2_pair: tuple[Tokenizer, object]) -> None:
    tok, _ = smollm2_pair
    im_end = tok.encode("<|im_end|>", add_bos=False)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.eot_ids == {2, *im_end, *tok.encode("<|endoftext|>", add_bos=False)}
    assert tok.token_bytes(tok.encode(" the", add_bos=False)[0]) == b" the"


def test_special_ids_gemma3(gemma3_pair: tuple[Tokenizer, object]) -> None:
    tok, _ = gemma3_pair
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (2, 1, 262144)
    assert tok.eot_ids == {1, *tok.encode("<end_of_turn>", add_bos=False)}
    assert tok.encode("<bos>hi") == tok.encode("hi")  # no second BOS
    assert tok.token_bytes(tok.encode("\n", add_bos=False)[0]) == b"\n"
    assert tok.decode([2, *tok.encode("hi", add_bos=False)], skip_special=True) == "hi"


def test_smollm2_file_template_matches_reference(
    smollm2_path: Path, smollm2_pair: tuple[Tokenizer, object]
) -> None:
    _, ref = smollm2_pair
    template = ChatTemplate.from_metadata(GGUFFile(smollm2_path).metadata)
    assert template.name == "file"
    for messages in MESSAGES:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert template.render(messages, add_generation_prompt=gen) == expected


def test_gemma3_builtin_template(gemma3_path: Path) -> None:
    template = ChatTemplate.from_metadata(GGUFFile(gemma3_path).metadata)
    assert template.name == "built-in gemma"
    assert template.render(MESSAGES[0]) == (
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert template.render(MESSAGES[1]) == (
        "<start_of_turn>user\nYou answer in one word.\n\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_builtin_templates_by_arch() -> None:
    chatml_vocab = {K.LIST: ["<s>", "</s>", "<|im_start|>", "<|im_end|>"], K.BOS_ID: 0, K.EOS_ID: 1}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    qwen = ChatTemplate.from_metadata(chatml_vocab, "qwen3").render(messages)
    assert qwen == chatml + "<|im_start|>assistant\n"
    assert ChatTemplate.from_metadata(chatml_vocab, "llama").render(messages) == qwen
    llama2 = ChatTemplate.from_metadata(
        {K.LIST: ["<s>", "</s>"], K.BOS_ID: 0, K.EOS_ID: 1}, "llama"
    )
    assert llama2.render([*messages, {"role": "assistant", "content": "Hello."}]) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s>"
    )
    with pytest.raises(UnsupportedError, match="no chat template"):
        ChatTemplate.from_metadata({K.LIST: ["a"]}, "bert")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% for %}", "does not compile"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ messages.append(1) }}", "unsafe"),
    ],
)
def test_template_errors_are_one_line(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message) as info:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_template_helpers() -> None:
    source = "{% generation %}{{ {'a': '<é>'} | tojson }}{% endgeneration %}{{ strftime_now('%Y')|length }}"
    assert ChatTemplate(source).render([]) == '{"a": "<é>"}4'


# llama.cpp's copy of gpt-oss's own template (harmony: channels, a developer turn, tools as a
# TypeScript namespace), from the source tree the build uses
GPT_OSS_TEMPLATE = (
    Path(
        os.environ.get(
            "LLAMA_CPP_TEMPLATES",
            "/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates",
        )
    )
    / "openai-gpt-oss-120b.jinja"
)


@pytest.mark.skipif(not GPT_OSS_TEMPLATE.is_file(), reason="no llama.cpp source tree here")
def test_gpt_oss_template_matches_transformers() -> None:
    """gpt-oss files carry their harmony template: it renders in our sandbox as transformers'
    own renderer renders it (system and developer turns, reasoning effort, a tool call with its
    thinking and the tool's answer)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = GPT_OSS_TEMPLATE.read_text()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    chats = [
        *MESSAGES,
        [
            {"role": "system", "content": "You add."},
            {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": "", "thinking": "Use add.", "tool_calls": [call]},
            {"role": "tool", "content": "5"},
        ],
    ]
    template = ChatTemplate(source, "<|startoftext|>", "<|return|>")
    for messages in chats:
        for extra in ({}, {"tools": tools, "reasoning_effort": "high"}):
            ours = template.render(messages, **extra)
            (theirs,), _ = render_jinja_template(
                conversations=[messages], chat_template=source, add_generation_prompt=True, **extra
            )
            assert ours == theirs
            assert ours.endswith("<|start|>assistant")


def _tiny_spm(add_space_prefix: bool) -> dict:
    """A SentencePiece vocabulary of a few pieces, bytes and <s>, </s>, <unk> (Llama 2 layout)."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w"]
    pieces += ["or", "ld", "orld", "▁world"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    scores[tokens.index("▁hello")] = 10.0
    return {
        K.MODEL: "llama", K.LIST: tokens, K.TOKEN_TYPE: types, K.SCORES: scores,
        K.BOS_ID: 1, K.EOS_ID: 2, K.UNK_ID: 0, K.ADD_PREFIX: add_space_prefix,
    }  # fmt: skip


def test_sentencepiece_space_prefix_and_byte_fallback() -> None:
    tok = Tokenizer(_tiny_spm(add_space_prefix=True))
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_id
    assert [tok.token_text(i) for i in ids[1:]] == ["▁hello", "▁world"]
    assert tok.decode(ids, skip_special=True) == "hello world"
    after_special = tok.encode("hello</s>hello", add_bos=False)
    assert [tok.token_text(i) for i in after_special] == ["▁hello", "</s>", "▁hello"]
    emoji = tok.encode("hé😀", add_bos=False)  # é and 😀 are not pieces: their UTF-8 bytes
    assert [tok.token_text(i) for i in emoji][:2] == ["▁", "h"]
    assert [tok.token_text(i) for i in emoji][2:] == [f"<0x{b:02X}>" for b in "é😀".encode()]
    assert tok.decode(emoji) == "hé😀"
    no_prefix = Tokenizer(_tiny_spm(add_space_prefix=False))
    assert [no_prefix.token_text(i) for i in no_prefix.encode("hello", add_bos=False)] == ["hello"]


def test_missing_or_unknown_tokenizer_model() -> None:
    with pytest.raises(ModelFileError, match="no vocabulary"):
        Tokenizer({})
    with pytest.raises(UnsupportedError, match="'bert'"):
        Tokenizer({K.MODEL: "bert", K.LIST: ["[CLS]", "a"]})


def test_unknown_pre_tokenizer_warns() -> None:
    meta = {K.MODEL: "gpt2", K.PRE: "martian", K.LIST: ["a", "b", "ab"], K.MERGES: ["a b"]}
    with pytest.warns(UserWarning, match="martian"):
        tok = Tokenizer(meta)
    assert tok.encode("abab") == [2, 2]


def test_reads_a_written_gguf(tmp_path: Path) -> None:
    meta = _tiny_spm(add_space_prefix=True)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(meta[K.MODEL])
    writer.add_token_list(meta[K.LIST])
    writer.add_token_types(meta[K.TOKEN_TYPE])
    writer.add_token_scores(meta[K.SCORES])
    writer.add_bos_token_id(meta[K.BOS_ID])
    writer.add_eos_token_id(meta[K.EOS_ID])
    writer.add_unk_token_id(meta[K.UNK_ID])
    writer.add_add_space_prefix(meta[K.ADD_PREFIX])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = Tokenizer(meta).encode("hello world")
    assert Tokenizer(gguf.GGUFReader(path)).encode("hello world") == expected
    assert Tokenizer.from_gguf(path).encode("hello world") == expected


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_every_known_pre_tokenizer_builds(pre: str) -> None:
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ", "ĉ", "Ġt", "Ġth"]
    meta = {K.MODEL: "gpt2", K.PRE: pre, K.LIST: alphabet, K.MERGES: ["Ġ t", "Ġt h"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = Tokenizer(meta)
    text = "The 12345 thing's\n\tdone!"
    assert tok.decode(tok.encode(text)) == text


def test_text_that_is_not_unicode_is_one_clear_error(smollm2_path: Path) -> None:
    """A lone surrogate (what Python makes of non-UTF-8 bytes in argv) used to reach the Rust
    tokenizer and raise a bare TypeError."""
    from potluck.errors import UnicodeTextError

    tok = Tokenizer(GGUFFile(smollm2_path).metadata)
    with pytest.raises(UnicodeTextError, match=r"character 3 is a lone surrogate U\+DC80"):
        tok.encode("abc\udc80def")
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "run", "-m", str(smollm2_path), "-n", "2",
         os.fsdecode(b"caf\xe9 au lait")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "not valid Unicode" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("harmony", [True, False])
def test_harmony_ends_a_turn_at_return_or_call_not_at_end(harmony: bool) -> None:
    """gpt-oss answers in two messages (analysis, then final), each closed by <|end|>: with
    <|return|> and <|call|> in the vocabulary only those end generation, as llama.cpp decides;
    elsewhere <|end|> ends a turn (phi3's)."""
    from potluck.modelfile.tokenizer import Tokenizer

    from ggufgen import tiny_vocab

    meta = tiny_vocab()
    extra = ["<|end|>", "<|return|>", "<|call|>"] if harmony else ["<|end|>"]
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[3] * len(extra)]
    tok = Tokenizer(meta)
    ids = {t: len(meta["tokenizer.ggml.tokens"]) - len(extra) + k for k, t in enumerate(extra)}
    if harmony:
        assert ids["<|end|>"] not in tok.eot_ids
        assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eot_ids
    else:
        assert ids["<|end|>"] in tok.eot_ids
