"""Token ids -> text, one token at a time: incremental detokenisation and stop strings.

A token need not end on a character boundary: with the byte tokenizer ``"é"`` is two tokens
(``0xC3 0xA9``), and a byte-level BPE token may hold half a character.  :class:`Detokenizer`
emits text only once it is complete, so a stream never shows a replacement character that the
final text does not have, and the concatenated pieces equal ``tokenizer.decode(all ids)``.

:class:`StopMatcher` holds back the text that could still become a stop string, so a stream
never shows text that the final (truncated) result does not contain.
"""

from __future__ import annotations

import codecs

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental ``ids -> str``: :meth:`push` a token id, get the text it completes (maybe
    ``""``); :meth:`flush` at the end returns what is left (an incomplete character there
    becomes U+FFFD, as ``decode`` would make it).

    Byte tokenizer (``tokenizer.kind == "byte"``): the bytes go through Python's incremental
    UTF-8 decoder with ``errors="replace"``, which gives exactly ``bytes.decode(errors="replace")``
    over the whole sequence.  Any other tokenizer: the "decode a suffix and diff" scheme
    (vLLM / HF ``TextStreamer``): decode the ids since the last emitted boundary and emit the new
    text unless it ends in U+FFFD (an unfinished character); special ids decode to nothing.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes = getattr(tokenizer, "kind", None) == "byte"
        if self._bytes:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._ids: list[int] = []
            self._prefix = 0  # ids[:_prefix] are fully emitted and never decoded again ...
            self._read = 0  # ... ids[_prefix:_read] are emitted but kept as left context

    def push(self, token: int) -> str:
        token = int(token)
        if self._bytes:
            if not 0 <= token < 256:  # specials are not text
                return ""
            return self._utf8.decode(bytes((token,)))
        self._ids.append(token)
        before = self.tokenizer.decode(self._ids[self._prefix : self._read])
        now = self.tokenizer.decode(self._ids[self._prefix :])
        if len(now) > len(before) and not now.endswith(_REPLACEMENT) and now.startswith(before):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        if self._bytes:
            return self._utf8.decode(b"", final=True)
        before = self.tokenizer.decode(self._ids[self._prefix : self._read])
        now = self.tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now.removeprefix(before)


class StopMatcher:
    """Finds the first stop string in a growing text and says how much text is safe to show.

    :meth:`push` takes new text and returns ``(safe_text, stopped)``: ``safe_text`` can be shown
    now; when ``stopped`` it is everything before the stop string and the caller ends the
    sample.  Text that is a prefix of some stop string is held back until it is decided;
    :meth:`flush` releases it (the sample ended without a stop string).  The final text is the
    text up to (not including) the earliest stop string.
    """

    def __init__(self, stop: list[str] | tuple[str, ...] = ()):
        stop = [s for s in stop if s]
        self.stop = stop
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stop:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
