"""A decode group's replies in one batch (issue 46): every rank merges the same sequences'
caches into one batch (`SeqBatch`), so one decode step of B replies is one call of each
rank's layers over [B, 1] tokens, not B calls one after another.

The ranks keep their batches alike by the orders alone: a "batch" order names the sequences
(their cache ids, in row order) and carries their tokens; a rank merges the ones its batch
lacks (mlx-lm's `merge`, then `extend`) and runs its stage. An "unbatch" order takes one
sequence out (mlx-lm's `extract` into its own caches again, `filter` for the rest), before
any other order can touch its caches (the prompt cache clones them).

`GroupBatch` is rank 0's side, with the interface of mlx-lm's `BatchGenerator` that the
decode node's scheduler uses (`insert`, `next_generated`, `remove`): each reply's own sampler,
logits processors and token limit, sampled as the lone loop samples (`generate.steps`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

Caches = list[Any]  # one sequence's per-layer caches on this rank


class SeqBatch:
    """This rank's caches of the sequences in the batch, merged layer by layer; `ids` their
    rows, in order."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.cache: Caches | None = None

    def sync(self, ids: Sequence[int], caches: Mapping[int, Caches]) -> Caches:
        """The batch of `ids` (the current rows, then new ones appended): the ones it lacks
        merged in from `caches`. Rows leave by `leave` only."""
        new = [i for i in ids if i not in self.ids]
        if new:
            lists = [caches[i] for i in new]
            merged = [layer[0].merge(list(layer)) for layer in zip(*lists, strict=True)]
            if self.cache is None:
                self.cache = merged
            else:
                for mine, more in zip(self.cache, merged, strict=True):
                    mine.extend(more)
            self.ids += new
        if self.ids != list(ids) or self.cache is None:
            raise ValueError(f"the batch holds {self.ids}, ordered {list(ids)}")
        return self.cache

    def leave(self, id: int) -> Caches:
        """Sequence `id` out of the batch: its own caches again (what it holds now)."""
        assert self.cache is not None
        row = self.ids.index(id)
        own = [c.extract(row) for c in self.cache]
        keep = [j for j in range(len(self.ids)) if j != row]
        if keep:
            for c in self.cache:
                c.filter(keep)
        else:
            self.cache = None
        self.ids.pop(row)
        return own


@dataclass
class _Row:
    uid: int
    caches: Any  # GroupCaches: its id names it to the other ranks
    token: int  # the next input
    left: int  # tokens still to give
    sample: Any
    processors: list[Any]
    history: mx.array | None  # the processors' tokens so far


@dataclass(frozen=True)
class Response:
    """One step of one reply, as mlx-lm's `BatchGenerator` gives it."""

    uid: int
    token: int
    logprobs: mx.array  # [vocab], after the processors
    finish_reason: str | None  # "length" at its token limit: it left the batch
    prompt_cache: Any  # its caches once it left, else None


class GroupBatch:
    """Rank 0's batch of a decode group's replies (see the module doc)."""

    def __init__(self, mirror: Any) -> None:
        self.mirror = mirror
        self.rows: list[_Row] = []
        self._uids = itertools.count()

    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        caches: Sequence[Any],
        all_tokens: Sequence[Sequence[int]],
        samplers: Sequence[Any],
        logits_processors: Sequence[list[Any]],
    ) -> list[int]:
        """Replies in, each from its next input (its last token) and its caches."""
        uids = []
        for prompt, n, c, seen, sample, procs in zip(
            prompts, max_tokens, caches, all_tokens, samplers, logits_processors, strict=True
        ):
            (token,) = prompt
            uid = next(self._uids)
            history = mx.array(list(seen)) if procs and seen else None
            self.rows.append(_Row(uid, c, token, n, sample, list(procs), history))
            uids.append(uid)
        return uids

    def next_generated(self) -> list[Response]:
        """One step of every reply; a reply at its token limit leaves with its caches."""
        rows = list(self.rows)
        if not rows:
            return []
        tokens = mx.array([[r.token] for r in rows], dtype=mx.int32)  # [B, 1]
        logits = self.mirror.batch_forward([r.caches for r in rows], tokens)[:, -1, :]
        sampled = [self._sample(r, logits[i : i + 1]) for i, r in enumerate(rows)]
        mx.eval(sampled)
        out = []
        for r, (y, lp) in zip(rows, sampled, strict=True):
            r.token, r.left = int(y.item()), r.left - 1
            done = r.left <= 0
            left = self._leave(r) if done else None
            out.append(Response(r.uid, r.token, lp[0], "length" if done else None, left))
        return out

    def remove(
        self, uids: Sequence[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[Any]]:
        """Replies out, each with its caches (every rank takes them out alike, whether the
        caller keeps them or not)."""
        gone = {}
        for r in [r for r in self.rows if r.uid in uids]:
            gone[r.uid] = (self._leave(r),)
        return gone if return_prompt_caches else {}

    def _sample(self, r: _Row, logits: mx.array) -> tuple[mx.array, mx.array]:
        """As `generate.steps` samples: the step's input joins the history, the processors,
        log-probabilities, the sampler. (token [1], log-probabilities [1, vocab])."""
        if r.processors:
            inputs = mx.array([r.token])
            r.history = inputs if r.history is None else mx.concatenate([r.history, inputs])
            for processor in r.processors:
                logits = processor(r.history, logits)
        lp = logits - mx.logsumexp(logits, keepdims=True)
        return r.sample(lp), lp

    def _leave(self, r: _Row) -> Any:
        self.rows.remove(r)
        self.mirror.unbatch(r.caches)
        return r.caches
