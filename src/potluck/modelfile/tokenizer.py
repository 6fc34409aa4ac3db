"""Tokenizer from GGUF metadata, built on Hugging Face `tokenizers`, with llama.cpp's semantics.

A GGUF file carries its vocabulary as metadata under `tokenizer.ggml.*`. Two kinds cover the
llama family:

- `gpt2`: byte-level BPE from vocab + merges (SmolLM, Llama 3, Qwen). How text is cut into words
  before BPE depends on `tokenizer.ggml.pre`; the regexes below follow llama.cpp's table.
- `llama`: SentencePiece-style BPE from vocab + scores (Llama 2, Mistral, Gemma). Spaces become
  '▁', characters missing from the vocabulary fall back to `<0xNN>` byte tokens, and merges are
  rebuilt from the scores (a merge ranks by the score of the token it makes).

Control tokens (`<|im_start|>`, `<start_of_turn>`) are matched whole in the text when
`parse_special=True`; user-defined tokens (Gemma's `\\n\\n`, runs of spaces) always are, as in
llama.cpp. Decoding maps each id to its bytes and joins them, so a stream of ids decodes exactly as
the whole sequence does.
"""

from __future__ import annotations

import codecs
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

import gguf
from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from potluck.errors import ModelFileError, UnicodeTextError, UnsupportedError
from potluck.modelfile.gguf_file import GGUFFile

_K = Keys.Tokenizer
_SPACE = "\u2581"  # '▁', SentencePiece's visible space

# Word-splitting regexes of byte-level vocabularies, applied in order (each splits the pieces the
# previous one left), as llama.cpp's `llm_tokenizer_bpe` does. Oniguruma (used by `tokenizers`)
# understands the original tokenizer.json patterns, so we keep those where llama.cpp rewrote them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for `tokenizer.ggml.pre = "default"` (older byte-level conversions).
_LLAMACPP_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"), (_GPT2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"),
        (_LLAMA3,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), (_QWEN2,)),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
    "default": _LLAMACPP_DEFAULT,
}
# Pre-types whose whole words are looked up in the vocabulary before BPE (llama.cpp's
# `ignore_merges`, tokenizer.json's `"ignore_merges": true`).
_IGNORE_MERGES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "gpt-4o", "llama4"}
)
# Texts of tokens that end a turn, besides the declared eos/eot/eom ids (llama.cpp's EOG list).
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
        "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
    }
)  # fmt: skip
_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED})


@cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted: char -> byte value (256 entries)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {ch: b for b, ch in spelling.items()}


def _metadata(source: Mapping[str, Any] | gguf.GGUFReader) -> Mapping[str, Any]:
    """Plain python values for the tokenizer keys of a GGUFReader, or the mapping as given."""
    if isinstance(source, gguf.GGUFReader):
        return {
            k: f.contents()
            for k, f in source.fields.items()
            if k.startswith("tokenizer.") or k == Keys.General.ARCHITECTURE
        }
    return source


class Tokenizer:
    """Text <-> token ids for the vocabulary a GGUF file describes.

    `metadata` is a GGUFReader or a plain dict of metadata key -> python value (for instance
    `GGUFFile(path).metadata`). Raises ModelFileError when the file has no usable vocabulary and
    UnsupportedError for a tokenizer model other than 'gpt2' or 'llama'.
    """

    def __init__(self, metadata: Mapping[str, Any] | gguf.GGUFReader) -> None:
        meta = _metadata(metadata)
        model = meta.get(_K.MODEL)
        tokens: Sequence[str] = meta.get(_K.LIST) or []
        if model is None or model in ("none", "no_vocab") or not tokens:
            raise ModelFileError(
                f"the GGUF file has no vocabulary ({_K.MODEL} = {model!r}, {len(tokens)} tokens)"
            )
        n = len(tokens)
        try:
            types = [TokenType(t) for t in meta.get(_K.TOKEN_TYPE) or [TokenType.NORMAL] * n]
        except ValueError as exc:
            raise ModelFileError(f"{_K.TOKEN_TYPE} holds an unknown token type ({exc})") from None
        if len(types) != n:
            raise ModelFileError(f"{_K.TOKEN_TYPE} has {len(types)} entries for {n} tokens")
        self.model: str = model
        self.pre: str | None = meta.get(_K.PRE)
        if model == "gpt2":
            self._hf = _byte_level_bpe(tokens, meta.get(_K.MERGES) or [], self.pre)
            self._pieces = _byte_level_pieces(tokens, types)
            self.add_space_prefix = False
            default_bos = False
        elif model == "llama":
            scores = meta.get(_K.SCORES)
            if scores is None or len(scores) != n:
                raise ModelFileError(f"{_K.SCORES} is missing or not one score per token ({n})")
            self.add_space_prefix = bool(meta.get(_K.ADD_PREFIX, True))
            unk_id = meta.get(_K.UNK_ID)
            self._hf = _sentencepiece_bpe(tokens, types, scores, unk_id, self.add_space_prefix)
            self._pieces = _sentencepiece_pieces(tokens, types)
            default_bos = True
        else:
            raise UnsupportedError(
                f"tokenizer model {model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE and 'llama' SentencePiece BPE)"
            )
        _add_special_tokens(self._hf, tokens, types)
        self._tokens = tokens
        self._special = frozenset(i for i, t in enumerate(types) if t in _SPECIAL_TYPES)
        self.add_bos: bool = bool(meta.get(_K.ADD_BOS, default_bos))
        self._bos: int | None = _valid_id(meta.get(_K.BOS_ID), n)
        self._eos: int | None = _valid_id(meta.get(_K.EOS_ID), n)
        declared = {_valid_id(meta.get(k), n) for k in (_K.EOS_ID, _K.EOT_ID, _K.EOM_ID)}
        named = {
            t: i
            for i, t in enumerate(tokens)
            if t in _END_OF_TURN_TEXTS and types[i] != TokenType.NORMAL
        }
        if "<|return|>" in named and "<|call|>" in named:
            # gpt-oss's harmony format: <|end|> closes one message (the analysis channel) and
            # the answer follows in the final channel; <|return|> and <|call|> end the turn
            # (as llama.cpp removes <|end|> from such a vocabulary's end-of-generation list)
            named.pop("<|end|>", None)
        self._eot = frozenset(i for i in declared | set(named.values()) if i is not None)
        # `encode_special_tokens` is a setting on the shared object; flip it only under this lock.
        self._lock = threading.Lock()

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read only the metadata of the file at `path` (fast: no GGUFReader) and build."""
        return cls(GGUFFile(path).metadata)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos, eot, eom and end-of-turn tokens like <|im_end|>."""
        return self._eot

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token as the file spells it ('Ġthe', '▁the', '<0x0A>', '<|im_end|>')."""
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control, unknown and unused tokens: the ones `skip_special` leaves out of text."""
        return token_id in self._special

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in text (a piece of a UTF-8 character, possibly)."""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(
                f"token id {token_id} is outside the vocabulary of {len(self._pieces)}"
            )
        return self._pieces[token_id]

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`.

        add_bos=None follows the file's `add_bos_token` rule, but adds no second BOS to a text
        that already starts with one (a chat template that writes `{{ bos_token }}`), as llama.cpp
        strips it. parse_special=False reads control tokens in the text as plain characters.
        Raises UnicodeTextError for text that is not valid Unicode (a lone surrogate: what Python
        makes of bytes that are not UTF-8 in a command line or a file read with surrogateescape).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnicodeTextError(
                f"the text is not valid Unicode: character {exc.start} is a lone surrogate "
                f"U+{ord(text[exc.start]):04X} (bytes that are not UTF-8?); give UTF-8 text"
            ) from None
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos and not (ids and ids[0] == self._bos)
        if add_bos and self._bos is not None:
            ids.insert(0, self._bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD.

        With add_space_prefix (Llama 2 style) the space the encoder put in front is taken off the
        first piece again, as llama.cpp and `transformers` do.
        """
        pieces = [self.token_bytes(i) for i in ids if not (skip_special and i in self._special)]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")


def _valid_id(value: Any, n: int) -> int | None:
    return int(value) if value is not None and 0 <= int(value) < n else None


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> HFTokenizer:
    if not merges:
        raise ModelFileError(f"byte-level vocabulary without merges ({_K.MERGES} is missing)")
    splits = PRE_TOKENIZER_SPLITS.get(pre or "default")
    if splits is None:
        warnings.warn(
            f"unknown {_K.PRE} {pre!r}: splitting words with GPT-2's regex; "
            "tokens may differ from llama.cpp's",
            stacklevel=3,
        )
        splits = (_GPT2,)
    pairs = cast(list[tuple[str, str]], [tuple(m.split(" ", 1)) for m in merges])
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf


def _byte_level_pieces(tokens: Sequence[str], types: Sequence[TokenType]) -> list[bytes]:
    """Bytes per id: normal tokens are spelled in GPT-2's byte alphabet, the rest as raw text."""
    alphabet = _byte_alphabet()

    def spelled(token: str) -> bytes:
        if all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
        return token.encode("utf-8")  # a mislabelled added token: keep its text

    return [
        spelled(t) if ty == TokenType.NORMAL else t.encode("utf-8")
        for t, ty in zip(tokens, types, strict=True)
    ]


def _sentencepiece_bpe(
    tokens: Sequence[str],
    types: Sequence[TokenType],
    scores: Sequence[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """BPE whose merges rank by the score of the token they make (llama.cpp's SPM bigram order).

    llama.cpp adds the prefix space to every run of text that starts the prompt or follows a
    special token; a `Prepend` normalizer does the same here, since `tokenizers` normalizes each
    run between added tokens on its own.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    hf = HFTokenizer(
        models.BPE(
            vocab,
            [(left, right) for *_, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=byte_fallback,
        )
    )
    to_space = normalizers.Replace(" ", _SPACE)
    hf.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), to_space])
        if add_space_prefix
        else to_space
    )
    return hf


def _sentencepiece_pieces(tokens: Sequence[str], types: Sequence[TokenType]) -> list[bytes]:
    """Bytes per id: '▁' is a space, `<0xNN>` is one byte, added tokens are their text."""

    def piece(token: str, ty: TokenType) -> bytes:
        if ty == TokenType.BYTE:
            return bytes([int(token[3:-1], 16)])
        if ty == TokenType.NORMAL:
            return token.replace(_SPACE, " ").encode("utf-8")
        return token.encode("utf-8")

    return [piece(t, ty) for t, ty in zip(tokens, types, strict=True)]


def _add_special_tokens(hf: HFTokenizer, tokens: Sequence[str], types: Sequence[TokenType]) -> None:
    """Control and unknown tokens match whole only when specials are parsed; user-defined always."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (TokenType.CONTROL, TokenType.UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == TokenType.USER_DEFINED
    ]
    hf.add_special_tokens(special)
    hf.add_tokens(user)


class StreamDecoder:
    """Turns token ids, one at a time, into text, holding back bytes of an unfinished character.

    The concatenation of every `push` and the final `flush` equals `tokenizer.decode(ids)` with the
    same `skip_special`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        """The text that is complete after this token ('' while a character is still partial)."""
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        piece = self._tok.token_bytes(token_id)
        if self._first and self._tok.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        self._first = False
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is left; an unfinished character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)
