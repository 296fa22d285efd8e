"""Incremental detokenization with stop strings.

Decoding each new token alone breaks multi-byte characters and drops the spaces that
SentencePiece/BPE attach to word starts, so each step decodes a short window that begins a
few tokens back (``prefix_offset``) and emits only the text past what that window already
produced. Text that could be the start of a stop string is held back from the stream until it
is known not to be one, so a caller never sees half of a stop string.
"""

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all decoded text so far (truncated at a stop string once one is found)
        self._sent = 0  # characters of self.text already handed out by take_delta()
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> bool:
        """Append one token; return True when a stop string has appeared."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return False  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if not self._stop:
            self.text += delta
            return False
        search_from = max(0, len(self.text) - max(len(s) for s in self._stop) + 1)
        self.text += delta
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
                self.stopped_by = stop
                return True
        return False

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out, minus a tail that might still grow into a stop string."""
        end = len(self.text)
        if not final and self.stopped_by is None:
            end -= self._held_back()
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest
