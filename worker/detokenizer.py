"""Streaming detokenization with stop strings, one instance per request.

Token → text uses ``protocol.tokenizer.DetokenizeState`` (never splits a UTF-8 character, keeps
SentencePiece spacing). On top of it, the last ``len(longest stop) - 1`` characters are held back
while they could still become a stop string; a matched stop string is cut, together with
everything after it, as OpenAI does.
"""
from __future__ import annotations

from protocol.tokenizer import DetokenizeState

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=None, stop: tuple[str, ...] = ()):
        self._state = DetokenizeState(tokenizer, prompt_ids=prompt_ids)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # decoded text so far (possibly ahead of what was emitted)
        self._emitted = 0  # chars of _text already handed out
        self.stopped_on: str | None = None

    @property
    def text(self) -> str:
        """All text released or held so far (after a stop match: the text before it)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Feed one token; return newly final text ("" when nothing is final yet). After a stop
        string matched, ``stopped_on`` is set and further input is ignored."""
        if self.stopped_on is not None:
            return ""
        delta = self._state.push(int(token_id))
        if not delta:
            return ""
        self._text += delta
        return self._release(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the stream."""
        if self.stopped_on is not None:
            return ""
        tail = self._state.flush()
        if tail:
            self._text += tail
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            # Emitted text was checked with ``_hold`` characters of lookahead, so a new match
            # cannot start before it.
            best = -1
            for s in self._stop:
                i = self._text.find(s, self._emitted)
                if i != -1 and (best == -1 or i < best):
                    best, self.stopped_on = i, s
            if best != -1:
                self._text = self._text[:best]
                return self._take(len(self._text))
        return self._take(len(self._text) if final else len(self._text) - self._hold)

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted:upto]
        self._emitted = upto
        return out
