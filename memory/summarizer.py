"""Summaries written by the model itself, within the session's budget.

A compaction summarizes the oldest unpinned turns together with the previous summary into a new
summary. The summarization requests are themselves requests on the session's KV, so each one's
prompt plus its reply must fit the budget: a long stretch of turns is folded in several passes,
each pass summarizing the running summary plus the next chunk. A summary that grows past its
share of the budget is summarized again (depth + 1), and as a last resort cut to fit, so the
front of the prompt is bounded whatever the model writes.
"""

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from memory.chat_render import Renderer
from memory.records import MessageRecord
from runtime.backends.backend import Backend, ChatPrompt
from runtime.engine.metrics import RequestMetrics
from runtime.engine.sampling import SamplingParams

SUMMARY_INSTRUCTIONS = (
    "You keep the running summary of a conversation between a user and an assistant. "
    "Write one updated summary that covers the previous summary and the new messages. "
    "Keep every name, number, date, file path, decision and open question exactly as written. "
    "Leave out greetings and filler. Use short factual sentences, at most {max_words} words."
)
SHORTEN_INSTRUCTIONS = (
    "Shorten this summary of a conversation to at most {max_words} words. Keep every name, number, "
    "date, file path, decision and open question exactly as written."
)
FOCUS_PREFIX = "Pay particular attention to: "
MAX_SUMMARY_DEPTH = 3
TRUNCATION_MARK = " […] "

# (kind, metrics, kv_tokens) for every request compaction makes, so the store can log it.
RequestObserver = Callable[[str, RequestMetrics, int], None]


def transcript_line(message: MessageRecord) -> str:
    return f"[turn {message.turn}] {message.role}: {message.content.strip()}"


@dataclass(slots=True)
class SummaryResult:
    text: str
    depth: int
    num_requests: int


class Summarizer:
    """Asks the model for summaries, never holding more KV than ``budget_tokens`` per request."""

    def __init__(
        self,
        backend: Backend,
        renderer: Renderer,
        max_summary_tokens: int,
        on_request: RequestObserver | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.max_summary_tokens = max_summary_tokens
        self.on_request = on_request

    def summarize(
        self,
        previous: str | None,
        messages: Sequence[MessageRecord],
        budget_tokens: int,
        cap_tokens: int,
        focus: str | None = None,
    ) -> SummaryResult:
        """Fold ``messages`` into ``previous``; the result has at most ``cap_tokens`` tokens."""
        reply_tokens = max(16, min(self.max_summary_tokens, cap_tokens))
        room = budget_tokens - reply_tokens  # the most one summarization prompt may take
        summary = previous or ""
        num_requests = 0
        for chunk in self._chunks(summary, messages, focus, reply_tokens, room):
            summary = self._ask(self._fold_prompt(summary, chunk, focus, reply_tokens), reply_tokens)
            num_requests += 1
        depth = 0
        while self.renderer.count("system", summary) > cap_tokens and depth < MAX_SUMMARY_DEPTH:
            focus_line = f"\n\n{FOCUS_PREFIX}{focus}" if focus else ""  # a focus outlives shortening
            text = _fit(self.renderer, summary, room - 64 - len(self.renderer.encode(focus_line)))
            shorten = [
                {"role": "system", "content": SHORTEN_INSTRUCTIONS.format(max_words=_words(cap_tokens))},
                {"role": "user", "content": text + focus_line},
            ]
            summary = self._ask(shorten, reply_tokens)
            num_requests += 1
            depth += 1
        if self.renderer.count("system", summary) > cap_tokens:
            summary = _truncate(self.renderer, summary, cap_tokens - 16)
        return SummaryResult(summary, depth, num_requests)

    def _fold_prompt(
        self, previous: str, lines: list[str], focus: str | None, reply_tokens: int
    ) -> list[dict[str, str]]:
        parts = [f"Previous summary:\n{previous or '(none yet)'}", "New messages:\n" + "\n".join(lines)]
        if focus:
            parts.append(f"{FOCUS_PREFIX}{focus}")
        return [
            {"role": "system", "content": SUMMARY_INSTRUCTIONS.format(max_words=_words(reply_tokens))},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def _ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for i, m in enumerate(messages):
            ids += self.renderer.message_ids(m["role"], m["content"], first=i == 0)
        return ids + self.renderer.generation_prompt_ids

    def _chunks(
        self, summary: str, messages: Sequence[MessageRecord], focus: str | None, reply_tokens: int, room: int
    ) -> Iterator[list[str]]:
        """Greedy chunks of transcript lines whose fold prompt fits ``room`` tokens.

        The running summary's size is bounded by ``reply_tokens``, so a chunk is sized against
        that bound rather than against the summary of the previous pass.
        """
        placeholder = "x " * max(reply_tokens, self.renderer.count("user", summary))
        base = len(self._ids(self._fold_prompt(placeholder, [], focus, reply_tokens)))
        chunk: list[str] = []
        used = base
        for message in messages:
            line = transcript_line(message)
            cost = self.renderer.count("user", line)  # close to its share of the user message
            if cost > room - base:
                line = _fit(self.renderer, line, room - base - 8)
                cost = self.renderer.count("user", line)
            if chunk and used + cost > room:
                yield chunk
                chunk, used = [], base
            chunk.append(line)
            used += cost
        if chunk:
            yield chunk

    def _ask(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        ids = self._ids(messages)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        parts: list[str] = []
        metrics: RequestMetrics | None = None
        for delta in self.backend.stream(ChatPrompt(messages, ids), params):
            parts.append(delta.text)
            if delta.finished:
                metrics = delta.metrics
        if metrics is not None and self.on_request is not None:
            self.on_request("summary", metrics, len(ids) + metrics.num_generated_tokens)
        text = collapse_repeats("".join(parts)).strip()
        if not text:  # a model that answers nothing still must not lose the previous summary
            text = messages[-1]["content"]
            text = _truncate(self.renderer, text, max_tokens)
        return text


def collapse_repeats(text: str) -> str:
    """Cut a loop the model fell into ("no no no no ...") down to one occurrence.

    Small models decoding greedily often repeat a phrase until ``max_tokens``; kept in the
    summary, the loop would take the front of every later prompt for nothing.
    """
    return _LOOP_RE.sub(r"\1", text) if len(text) < 20_000 else text


# A span of 1-80 characters ending at a word boundary, followed by at least 3 more copies of itself.
_LOOP_RE = re.compile(r"(\S.{0,79}?\b\W*)\1{3,}", re.DOTALL)


def _words(tokens: int) -> int:
    return max(20, int(tokens * 0.6))


def _truncate(renderer: Renderer, text: str, max_tokens: int) -> str:
    ids = renderer.encode(text)
    if len(ids) <= max_tokens:
        return text
    return str(renderer.tokenizer.decode(ids[: max(1, max_tokens)])).rstrip() + TRUNCATION_MARK.rstrip()


def _fit(renderer: Renderer, text: str, max_tokens: int) -> str:
    """Keep the head and the tail of ``text`` within ``max_tokens`` (names often sit at either end)."""
    ids = renderer.encode(text)
    if len(ids) <= max_tokens:
        return text
    half = max(1, max_tokens // 2 - 4)
    head = renderer.tokenizer.decode(ids[:half])
    tail = renderer.tokenizer.decode(ids[-half:])
    return f"{head}{TRUNCATION_MARK}{tail}"
