"""StopText (api/text.py) over a fake vocabulary of byte strings: text that may begin a stop
sequence is held back until it is known not to, the stop text and everything after it is never
released, characters split across tokens come out whole, and every token is accounted for once."""

from __future__ import annotations

import random

import pytest

from potluck.api.text import StopText

# id -> bytes: words, pieces that stop sequences span, and "é" (C3 A9) split over two ids
PIECES = [b"Hel", b"lo", b" wor", b"ld", b"\n", b"\n\n", b"##", b"#", b"END", b"E", b"ND", b"x",
          b"\xc3", b"\xa9", b" caf", b"\xc3\xa9"]  # fmt: skip


class Vocab:
    """What StopText's stream decoder reads of a tokenizer."""

    add_space_prefix = False

    def token_bytes(self, token_id: int) -> bytes:
        return PIECES[token_id]

    def is_special(self, token_id: int) -> bool:
        return False


def ids(*pieces: bytes) -> list[int]:
    return [PIECES.index(p) for p in pieces]


def feed(st: StopText, tokens: list[int]) -> tuple[list[str], list[int]]:
    """Every push and the final flush: the texts released (one per call) and the ids covered."""
    texts, covered = [], []
    for t in tokens:
        text, got = st.push(t)
        texts.append(text)
        covered += got
    text, got = st.flush()
    return [*texts, text], covered


def test_no_stop_sequence_releases_each_token_at_once() -> None:
    st = StopText(Vocab(), [])
    tokens = ids(b"Hel", b"lo", b" wor", b"ld")
    texts, covered = feed(st, tokens)
    assert texts == ["Hel", "lo", " wor", "ld", ""]
    assert covered == tokens and not st.stopped


def test_a_stop_sequence_across_tokens_is_never_released() -> None:
    st = StopText(Vocab(), ["o w"])
    texts, covered = feed(st, ids(b"Hel", b"lo", b" wor", b"ld"))
    assert "".join(texts) == "Hell" and st.stopped
    assert texts[:2] == ["Hel", "l"]  # "o" is held back: it may begin "o w"
    assert covered == ids(b"Hel", b"lo")  # "lo" began before the stop text: it is covered
    assert st.push(ids(b"x")[0]) == ("", [])  # nothing after the stop


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    st = StopText(Vocab(), ["END"])
    assert st.push(ids(b"E")[0]) == ("", [])  # "E" may begin "END"
    assert st.push(ids(b"x")[0]) == ("Ex", ids(b"E", b"x"))
    assert st.push(ids(b"E")[0]) == ("", [])
    assert st.flush() == ("E", ids(b"E"))  # the end: what was held goes out
    assert not st.stopped


def test_the_earliest_of_several_stop_sequences_wins() -> None:
    st = StopText(Vocab(), ["\n\n", "##", ""])  # an empty stop string is ignored
    texts, covered = feed(st, ids(b"Hel", b"#", b"lo", b"#", b"#", b"\n\n"))
    assert "".join(texts) == "Hel#lo" and st.stopped
    assert covered == ids(b"Hel", b"#", b"lo")
    # two found in one push: the one earlier in the text, whatever the order of the list
    st = StopText(Vocab(), ["o w", "wor"])
    texts, _ = feed(st, ids(b"Hel", b"lo", b" wor"))
    assert "".join(texts) == "Hell"


def test_a_character_split_over_two_tokens_comes_out_whole() -> None:
    st = StopText(Vocab(), [])
    assert st.push(ids(b" caf")[0]) == (" caf", ids(b" caf"))
    assert st.push(ids(b"\xc3")[0]) == ("", ids(b"\xc3"))  # half a character: no text yet
    assert st.push(ids(b"\xa9")[0]) == ("é", ids(b"\xa9"))
    assert st.flush() == ("", [])
    assert st.text == " café"


def test_a_stop_sequence_after_a_split_character() -> None:
    st = StopText(Vocab(), ["é#"])
    texts, _ = feed(st, ids(b" caf", b"\xc3", b"\xa9", b"#", b"x"))
    assert "".join(texts) == " caf" and st.stopped


@pytest.mark.parametrize("seed", range(40))
def test_released_text_is_the_text_up_to_the_first_stop(seed: int) -> None:
    """Random streams and stop sets: what is released, joined, is the decoded text up to the
    first stop sequence (all of it when there is none); each id is covered at most once, in
    order, and every id is covered when no stop sequence ended the stream."""
    rng = random.Random(seed)
    tokens = [rng.randrange(len(PIECES)) for _ in range(rng.randint(0, 30))]
    stops = rng.sample(["\n\n", "##", "END", "lo w", "o", "é", "\ufffd#"], rng.randint(0, 3))
    st = StopText(Vocab(), stops)
    texts, covered = feed(st, tokens)
    whole = b"".join(PIECES[t] for t in tokens).decode("utf-8", errors="replace")
    hits = [i for i in (whole.find(s) for s in stops) if i >= 0]
    want = whole[: min(hits)] if hits else whole
    assert "".join(texts) == want and st.stopped == bool(hits)
    assert covered == tokens[: len(covered)]
    if not hits:
        assert covered == tokens
