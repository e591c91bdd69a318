"""One request's reply, built token by token on the mlx thread: the text its tokens make
(stop strings held back and cut, the eos token and the token limit), its log-probabilities,
and the `Generation` it ends with. Whatever made the tokens (a lone token loop, or a step of
the batch every running reply shares: `batching.py`), the reply reads the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.nodes.decode.generate import Step, top_logprobs
from tandem.nodes.decode.openai_api import Sampling, TokenLogprob


@dataclass
class Generation:
    """What one decode produced; `text` excludes any stop string."""

    text: str = ""
    tokens: int = 0
    finish_reason: str = "length"
    first_token_s: float = 0.0  # from the reply's start to the first token (local prefill in)
    decode_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    token_at: list[float] = field(default_factory=list)  # perf_counter() of each token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where the request asks

    @property
    def first_token_at(self) -> float | None:
        """time.perf_counter() when the first token was sampled."""
        return self.token_at[0] if self.token_at else None

    @property
    def steady_tok_s(self) -> float | None:
        """Decode rate once the pipeline runs: tokens after the second over the time from the
        second to the last (the first interval fills the one-step lookahead)."""
        if len(self.token_at) < 3 or self.token_at[-1] <= self.token_at[1]:
            return None
        return (len(self.token_at) - 2) / (self.token_at[-1] - self.token_at[1])


class Reply:
    """The reply of one request as its tokens arrive (`add`), until `done`."""

    def __init__(
        self, tokenizer: Any, params: Sampling, on_token: Callable[[int], None] | None = None
    ) -> None:
        self.params, self.on_token = params, on_token
        self._decode = tokenizer.decode
        self._eos = set(tokenizer.eos_token_ids)
        self._text = _Text(tokenizer.detokenizer, params.stop)  # a detokenizer of its own
        self.out = Generation()
        self.done = False
        self._t0 = time.perf_counter()

    def add(self, step: Step) -> str:
        """Take the next token: the text it makes ready to hand out ('' for none yet)."""
        if self.done:
            raise ValueError("the reply has ended")
        out, token = self.out, step.token
        if self.params.logprobs:
            alternatives = tuple(
                (self._decode([t]), lp)
                for t, lp in top_logprobs(step.logprobs, self.params.top_logprobs)
            )
            out.logprobs.append(TokenLogprob(self._decode([token]), step.logprob, alternatives))
        out.token_at.append(time.perf_counter())
        out.tokens += 1
        out.token_ids.append(token)
        if self.on_token is not None:
            self.on_token(out.tokens)
        if token in self._eos:
            out.finish_reason = "stop"
            return self._finish()
        last = out.tokens == self.params.max_tokens
        piece, stopped = self._text.add(token, last=last)
        if stopped:
            out.finish_reason = "stop"
            self._end()
            return piece
        return piece + self._finish() if last else piece

    @property
    def left(self) -> int:
        """Tokens it may still take."""
        return 0 if self.done else self.params.max_tokens - self.out.tokens

    def _finish(self) -> str:
        """An eos or the token limit: flush what the text holds back."""
        piece, stopped = self._text.finish()
        if stopped:
            self.out.finish_reason = "stop"
        self._end()
        return piece

    def _end(self) -> None:
        out = self.out
        out.first_token_s = out.token_at[0] - self._t0 if out.token_at else 0.0
        out.decode_s = time.perf_counter() - self._t0 - out.first_token_s
        self.done = True


class _Text:
    """The detokenizer's text, held back while it could still be the start of a stop
    string; cut at the first stop string."""

    def __init__(self, detokenizer: Any, stops: Sequence[str]) -> None:
        self.detokenizer, self.stops = detokenizer, [s for s in stops if s]
        self.pending = ""
        self.hold = max((len(s) for s in self.stops), default=0)

    def add(self, token: int, last: bool) -> tuple[str, bool]:
        """(text ready to hand out, whether a stop string ended it) after `token`. The last
        token's text stays held for `finish`."""
        self.detokenizer.add_token(token)
        self.pending += self.detokenizer.last_segment
        if (stop_at := self._find_stop()) is not None:
            ready, self.pending = self.pending[:stop_at], ""
            return ready, True
        if last:
            return "", False
        ready = len(self.pending) - (self.hold - 1 if self.hold else 0)
        if ready <= 0:
            return "", False
        out, self.pending = self.pending[:ready], self.pending[ready:]
        return out, False

    def finish(self) -> tuple[str, bool]:
        self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        if (stop_at := self._find_stop()) is not None:
            return self.pending[:stop_at], True
        return self.pending, False

    def _find_stop(self) -> int | None:
        if not self.stops:
            return None
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        return min(hits) if hits else None
