"""From generated ids to the text a client sees: streaming detokenization with text-level stop
sequences (the stop text and everything after it is never sent), and which tokens each released
piece of text covers (for logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

from potluck.modelfile.tokenizer import StreamDecoder, Tokenizer


class StopText:
    """Feed ids with `push`; each call returns (text now safe to send, ids that text covers).

    Text that could be the start of a stop sequence is held back until it is known not to be;
    once a stop sequence appears, `stopped` is set and the text before it is the last released.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._dec = StreamDecoder(tokenizer)
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` released
        self._pending: list[tuple[int, int, int]] = []  # (id, start, end) offsets in `text`
        self.stopped = False

    def push(self, token: int) -> tuple[str, list[int]]:
        if self.stopped:
            return "", []
        start = len(self.text)
        self.text += self._dec.push(token)
        self._pending.append((token, start, len(self.text)))
        return self._release(final=False)

    def flush(self) -> tuple[str, list[int]]:
        """The rest, at the end of generation (unless a stop sequence already ended it)."""
        if self.stopped:
            return "", []
        start = len(self.text)
        self.text += self._dec.flush()
        if self._pending and len(self.text) > start:  # the tail belongs to the last token
            tok, a, _ = self._pending[-1]
            self._pending[-1] = (tok, a, len(self.text))
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, list[int]]:
        cut = len(self.text)
        hit = -1
        for s in self.stops:
            i = self.text.find(s, self.sent)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            cut, self.stopped = hit, True
        elif not final:
            cut -= self._held_back(self.text[self.sent :])
        out = self.text[self.sent : cut]
        self.sent = cut
        if self.stopped:  # tokens that began before the stop text (their visible part was sent)
            ids = [t for t, a, _ in self._pending if a < cut]
            self._pending = []
        else:
            ids = [t for t, _, b in self._pending if b <= cut]
            self._pending = [p for p in self._pending if p[2] > cut]
        return out, ids

    def _held_back(self, tail: str) -> int:
        """Length of the longest end of `tail` that begins some stop sequence."""
        for k in range(min(len(tail), self._longest - 1), 0, -1):
            end = tail[-k:]
            if any(s.startswith(end) for s in self.stops):
                return k
        return 0
