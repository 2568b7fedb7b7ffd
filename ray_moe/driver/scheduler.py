"""Continuous batching on the driver (pure: no Ray).

Requests join a FIFO queue; between steps they are admitted to the rank with the most free KV blocks (a
request reserves blocks for its prompt plus ``max_new_tokens`` when admitted, so an admitted request always
runs to completion and nothing is preempted); every step gives each rank the next chunk of each of its
sequences: a prefill chunk (up to the step's token budget) or one decode token. A step of decode tokens only,
with no request waiting, runs ``decode_steps`` decode sub-steps in one call (multi-step decode: the rank feeds
each sampled token back as the next input; bounded by the fewest tokens any of its sequences still needs, so
no sequence runs past its reservation; tokens after an end-of-sequence are dropped). A request that can never fit
a rank's KV budget or the model's context is refused at submission with an error naming the numbers; the
others are unaffected. Sequences of a rank that leaves (removed or killed) go back to the queue head with
what they generated so far and are re-prefilled elsewhere. A step that ran out of device memory gives its
sequences back the same way (``preempt``: recompute) and halves the step's prefill budget and the running
sequences (``memory_backoff``); each budget doubles back towards its configured value after
``RECOVER_AFTER_STEPS`` clean steps.

Prefix caching (``prefix_caching``; the shards share KV blocks of identical prompt prefixes, ``shard/prefix.py``):
a prefill chunk that does not reach the end of its sequence ends on a block boundary (a shard looks cached
blocks up chunk after chunk; a sequence whose budget share this step does not reach its next boundary waits a
step). Prefix-aware assignment: the scheduler keeps a bounded LRU index of
which rank was recently given which prompt blocks (the chained block hashes of ``model/prefix_cache.py``, the
names the shards cache their KV blocks under; approximate: a rank may have evicted them since). A new request
goes to the rank with the longest run of its prompt's leading blocks in that index, unless that rank runs more
than ``prefix_slack`` sequences beyond the least-loaded rank that fits it (then, as without a match, the
least-loaded one): a shared prefix is computed once per rank instead of once per request. Matched blocks that
rank has already prefilled (a committed step covered them) count outside the step's prefill budget (expected
cached: no compute); blocks only assigned so far (a burst of requests with one prefix) route, not budget.

    sched = Scheduler(ranks=[0, 1], kv_blocks=256, block_size=16, max_context=4096)
    rid = sched.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
    plan = sched.plan()                      # StepPlan: per-rank work items
    events = sched.commit(plan, sampled)     # sampled: {seq_id: token, or plan.steps tokens}
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Mapping, Sequence

import numpy as np

from ray_moe.model.kv import KVBudgetError
from ray_moe.model.prefix_cache import chain_hashes
from ray_moe.model.sampling import SampleSpec, SamplingParams, TokenLogprobs
from ray_moe.shard.records import WorkItem


class SeqState(str, Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"


@dataclass
class SeqStatus:
    """One request's sequence as the driver tracks it."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    generated: list[int] = field(default_factory=list)
    rank: int | None = None
    cached: int = 0  # tokens of prompt + generated already written to the rank's KV cache
    state: SeqState = SeqState.WAITING
    moves: int = 0  # times the sequence was re-prefilled on another rank
    submitted: float = field(default_factory=time.monotonic)  # when it was submitted (monotonic s)

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.generated]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_slice(self, a: int, b: int) -> tuple[int, ...]:
        """tokens[a:b] without building the whole list (a decode step needs one token)."""
        p = len(self.prompt)
        if a >= p:
            return tuple(self.generated[a - p:b - p])
        return (*self.prompt[a:b], *self.generated[:max(0, b - p)])

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


@dataclass(frozen=True)
class StepPlan:
    """Every rank's work in one step; ``free``: sequences each rank must drop from its cache first.
    ``steps``: decode sub-steps (> 1 only when every item is a decode item): each item's rank feeds the token
    it samples at position p back as the input at p and samples p + 1, ``steps`` tokens per item in all."""

    step: int
    items: dict[int, tuple[WorkItem, ...]]
    free: dict[int, tuple[str, ...]]
    steps: int = 1

    @property
    def has_decode(self) -> bool:
        return any(i.decode for items in self.items.values() for i in items)

    @property
    def has_prefill(self) -> bool:
        return any(not i.decode for items in self.items.values() for i in items)

    @property
    def empty(self) -> bool:
        return not any(self.items.values())


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``logprobs`` when the request asked for them."""

    request_id: str
    token: int
    finished: bool
    logprobs: TokenLogprobs | None = None


RECOVER_AFTER_STEPS = 64  # clean steps after a memory backoff before the budgets double back
# a cache sized from GPU memory that gives each of a rank's running sequences fewer tokens than this, on average,
# is named at start: the running limit then outruns the cache (the 48-layer Qwen3-30B-A3B shape in bf16 on one
# 80 GB H100: 84,576 tokens, 330 each for 256 sequences and 82 for 1,024, below the ~600 of the mixed benchmark's
# requests; on an H200, 647,472 tokens: 632 each for 1,024)
THIN_KV_TOKENS_PER_SEQUENCE = 512
# prefix-aware assignment: a rank that holds a request's prompt prefix takes it while it runs at most this many
# sequences more than the least-loaded rank that fits the request
PREFIX_LOAD_SLACK = 4


@dataclass(frozen=True)
class KvCapacity:
    """One rank's KV cache against its running limit: kv_tokens (blocks x block size), rank_running (sequences
    one rank runs at most), max_context (the model's positions). A request reserves its prompt plus
    ``max_new_tokens`` when admitted, so sequences longer than ``tokens_per_sequence`` on average run fewer at
    once than the running limit."""

    kv_tokens: int
    rank_running: int
    max_context: int

    @property
    def tokens_per_sequence(self) -> int:
        """Tokens each running sequence gets on average when the rank runs its limit."""
        return self.kv_tokens // max(1, self.rank_running)

    @property
    def full_context_sequences(self) -> float:
        """Sequences of the model's whole context the cache holds at once (vLLM's "maximum concurrency")."""
        return self.kv_tokens / max(1, self.max_context)

    def note(self) -> str:
        return (f"KV cache: {self.kv_tokens:,} tokens a rank; {self.rank_running} running sequences a rank get "
                f"{self.tokens_per_sequence:,} tokens each on average; {self.full_context_sequences:.2f} sequences "
                f"of the model's whole context ({self.max_context:,} tokens) at once")

    def warning(self) -> str | None:
        """The start warning where the running limit outruns the cache (None: it does not)."""
        if self.tokens_per_sequence >= THIN_KV_TOKENS_PER_SEQUENCE:
            return None
        return (f"the KV cache holds {self.kv_tokens:,} tokens a rank: {self.rank_running} running sequences a rank "
                f"get {self.tokens_per_sequence:,} tokens each on average, and a request reserves its prompt + "
                f"max_tokens when admitted, so longer requests run fewer at once than the running limit (decode "
                f"steps below it; the KV cache, not the kernels, bounds throughput). More of the GPU "
                f"(--gpu-memory-utilization), fewer running sequences (--max-num-seqs) or more ranks "
                f"(--data-parallel-size) give each more")


class Scheduler:
    """kv_blocks / block_size: every rank's cache; max_context: the model's positions; step_tokens: the
    prefill token budget of one rank in one step (decode tokens always run); max_running: sequences in flight
    over every rank, rank_running: on one rank (None: max_running); decode_steps: the most decode
    sub-steps of one step (multi-step decode; 1: one token per sequence per step); keep_finished: finished
    sequences kept for inspection (``status``), the oldest dropped first. prefix_caching: route a new request
    to the rank that recently got its prompt's prefix (module docstring), within ``prefix_slack`` sequences of
    the least-loaded rank; ``prefix_index_blocks``: the index's bound (default: every rank's blocks, at most
    2**18); ``prefix_routed`` counts the requests it sent elsewhere than the least-loaded rank.

    ``seqs`` holds the live (waiting and running) sequences only: a finished one moves to the bounded
    ``finished`` record, so a long-running server's per-step work and memory do not grow with every request
    it ever served; ``moved`` counts re-prefills (sequences of departed ranks) over the scheduler's life."""

    def __init__(self, ranks: Sequence[int], *, kv_blocks: int, block_size: int, max_context: int,
                 step_tokens: int = 2048, max_running: int = 256, eos_token_ids: Iterable[int] = (),
                 decode_steps: int = 1, keep_finished: int = 1024, prefix_caching: bool = True,
                 prefix_slack: int = PREFIX_LOAD_SLACK, prefix_index_blocks: int | None = None,
                 rank_running: int | None = None) -> None:
        if not 1 <= int(decode_steps) <= 64:
            raise ValueError(f"decode_steps={decode_steps}: must be in [1, 64]")
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching={prefix_caching!r}: must be a bool")
        if int(prefix_slack) < 0:
            raise ValueError(f"prefix_slack={prefix_slack}: must be >= 0")
        if prefix_index_blocks is not None and int(prefix_index_blocks) < 1:
            raise ValueError(f"prefix_index_blocks={prefix_index_blocks}: must be >= 1")
        self.prefix_caching, self.prefix_slack = prefix_caching, int(prefix_slack)
        self.prefix_index_blocks = int(prefix_index_blocks or min(1 << 18, int(kv_blocks) * max(1, len(ranks))))
        # (rank, block hash) -> whether that rank has prefilled it (a committed step covered it), LRU first
        self._prefix_index: OrderedDict[tuple[int, int], bool] = OrderedDict()
        self._expect: dict[str, int] = {}  # prompt tokens a new sequence's rank likely caches (index matches)
        self._prompt_blocks: dict[str, tuple[list[int], int]] = {}  # running prefill: (its hashes, marked)
        self.prefix_routed = 0
        if int(keep_finished) < 0:
            raise ValueError(f"keep_finished={keep_finished}: must be >= 0")
        self.keep_finished = int(keep_finished)
        self.finished: OrderedDict[str, SeqStatus] = OrderedDict()
        self.moved = 0
        self.decode_steps = int(decode_steps)
        self.ranks = list(ranks)
        self.kv_blocks = int(kv_blocks)
        self.block_size = int(block_size)
        self.max_context = int(max_context)
        self.step_tokens = int(step_tokens)
        self.max_running = int(max_running)
        # sequences one rank runs at most (the step lattice's decode sizes stop there; None: max_running)
        self.rank_running = int(rank_running) if rank_running is not None else self.max_running
        if self.rank_running < 1:
            raise ValueError(f"rank_running={rank_running}: must be >= 1")
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.seqs: dict[str, SeqStatus] = {}
        self._queue: deque[str] = deque()
        self._used: dict[int, int] = {r: 0 for r in self.ranks}  # blocks reserved per rank
        self._to_free: dict[int, list[str]] = {r: [] for r in self.ranks}
        self._ids = itertools.count()
        self._steps = itertools.count()
        # memory backoff: the configured budgets, and the clean steps since the last backoff
        self.configured = (self.step_tokens, self.max_running)
        self.preempted = 0  # sequences given back to the queue by a failed (out of memory) step
        self.backoffs = 0
        self._clean = 0

    # ------------------------------------------------------------------ requests
    def blocks(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_size)

    def check(self, prompt: Sequence[int], params: SamplingParams, vocab_size: int | None = None) -> None:
        """Refuse a request that can never run, naming the field and the limit (nothing changes)."""
        if not prompt:
            raise ValueError("prompt: empty (at least one token id)")
        if vocab_size is not None:
            ids = np.asarray(prompt)
            if ids.dtype.kind not in "iu":
                ids = np.asarray([int(t) for t in prompt], dtype=np.int64)
            bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
            if bad.size:
                raise ValueError(f"prompt: token id {int(ids[bad[0]])} is out of range [0, {vocab_size})")
            far = [t for t, _ in params.logit_bias if t >= vocab_size]
            if far:
                raise ValueError(f"logit_bias: token id {far[0]} is outside the vocabulary [0, {vocab_size})")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_context:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} = {total} exceeds "
                             f"the model's context of {self.max_context} positions")
        if self.blocks(total) > self.kv_blocks:
            raise KVBudgetError(f"prompt: {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} = {total} tokens "
                                f"need {self.blocks(total)} KV blocks of {self.block_size}; a rank's budget is "
                                f"{self.kv_blocks} blocks ({self.kv_blocks * self.block_size} tokens)")

    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               vocab_size: int | None = None) -> str:
        self.check(prompt, params, vocab_size)
        return self.enqueue(prompt, params, request_id=request_id)

    def enqueue(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None) -> str:
        """Queue a request ``check`` already accepted (``submit`` without the check: a batch checks first)."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs or rid in self.finished or any(rid in names for names in self._to_free.values()):
            # (a finished id stays refused while a step planned for it may still be committed)
            raise ValueError(f"request_id={rid!r} is already in use (running, waiting or recently finished)")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.seqs[rid] = SeqStatus(rid, tuple(map(int, prompt)), params, seed)
        self._queue.append(rid)
        return rid

    def cancel(self, rid: str) -> None:
        s = self.seqs.get(rid)
        if s is not None and s.state is not SeqState.FINISHED:
            self._finish(s)

    def pending(self) -> int:
        """Requests not finished (waiting or running)."""
        return len(self.seqs)

    def status(self, rid: str) -> SeqStatus | None:
        """A live sequence, or one of the last ``keep_finished`` finished ones; None when unknown."""
        return self.seqs.get(rid) or self.finished.get(rid)

    # ------------------------------------------------------------------ membership
    def set_ranks(self, ranks: Sequence[int]) -> list[str]:
        """New group membership: sequences of ranks that left go back to the queue head (re-prefill)."""
        gone = [r for r in self.ranks if r not in ranks]
        moved = []
        for s in self.seqs.values():
            if s.rank in gone and s.state is SeqState.RUNNING:
                s.rank, s.cached, s.state = None, 0, SeqState.WAITING
                self._expect.pop(s.request_id, None)
                self._prompt_blocks.pop(s.request_id, None)
                s.moves += 1
                self.moved += 1
                moved.append(s.request_id)
        for rid in reversed(moved):
            self._queue.appendleft(rid)
        self.ranks = list(ranks)
        self._used = {r: self._used.get(r, 0) for r in self.ranks}
        for r in gone:
            self._used.pop(r, None)
        if gone:  # their caches went with them
            for key in [k for k in self._prefix_index if k[0] in gone]:
                del self._prefix_index[key]
        self._to_free = {r: self._to_free.get(r, []) for r in self.ranks}  # departed ranks took their caches
        return moved

    # ------------------------------------------------------------------ memory pressure
    def preempt(self, plan: StepPlan) -> list[str]:
        """The running sequences of a failed ``plan`` go back to the queue head in plan order (recompute: their
        KV reservation is released and their ranks drop the cache with the next step; what they generated is
        kept and re-prefilled). Returns their ids."""
        back = []
        for r, items in plan.items.items():
            for it in items:
                s = self.seqs.get(it.seq_id)
                if s is None or s.state is not SeqState.RUNNING or s.request_id in back:
                    continue
                if s.rank in self._used:
                    self._used[s.rank] -= self.blocks(s.reserve_tokens)
                    self._to_free[s.rank].append(s.request_id)
                s.rank, s.cached, s.state = None, 0, SeqState.WAITING
                self._expect.pop(s.request_id, None)
                self._prompt_blocks.pop(s.request_id, None)
                back.append(s.request_id)
        for rid in reversed(back):
            self._queue.appendleft(rid)
        self.preempted += len(back)
        return back

    def memory_backoff(self) -> tuple[int, int]:
        """Halve the prefill budget of a step (not below one block) and the running sequences (not below one);
        returns the new (step_tokens, max_running)."""
        self.step_tokens = max(self.block_size, self.step_tokens // 2)
        self.max_running = max(1, self.max_running // 2)
        self.backoffs += 1
        self._clean = 0
        return self.step_tokens, self.max_running

    def step_succeeded(self) -> None:
        """A step committed: after ``RECOVER_AFTER_STEPS`` clean ones the budgets double back (up to their
        configured values)."""
        if (self.step_tokens, self.max_running) == self.configured:
            return
        self._clean += 1
        if self._clean >= RECOVER_AFTER_STEPS:
            self._clean = 0
            self.step_tokens = min(self.configured[0], self.step_tokens * 2)
            self.max_running = min(self.configured[1], self.max_running * 2)

    # ------------------------------------------------------------------ steps
    def _admit(self) -> None:
        if not self._queue:
            return
        loads = {r: 0 for r in self.ranks}
        for x in self.seqs.values():
            if x.state is SeqState.RUNNING and x.rank in loads:
                loads[x.rank] += 1
        running = sum(loads.values())
        while self._queue and running < self.max_running:
            s = self.seqs.get(self._queue[0])
            if s is None:  # cancelled while waiting
                self._queue.popleft()
                continue
            need = self.blocks(s.reserve_tokens)
            fits = [r for r in self.ranks if self.kv_blocks - self._used[r] >= need and loads[r] < self.rank_running]
            if not fits:
                return  # FIFO: the head waits for blocks (or a rank's running sequences) to free up
            r = min(fits, key=lambda u: (loads[u], self._used[u], u))
            hashes = self._prefix_hashes(s)
            if hashes:
                r = self._prefix_rank(s.request_id, hashes, fits, loads, r)
            self._queue.popleft()
            self._used[r] += need
            s.rank, s.cached, s.state = r, 0, SeqState.RUNNING
            loads[r] += 1
            running += 1

    def _prefix_hashes(self, s: SeqStatus) -> list[int]:
        """The chained hashes of the prompt's full blocks a rank can share (never the last token's block, as
        the shards) with prefix caching on; else []."""
        if not self.prefix_caching:
            return []
        return chain_hashes(None, s.prompt[:len(s.prompt) - 1], self.block_size)

    def _prefix_rank(self, s_id: str, hashes: list[int], fits: list[int], loads: dict[int, int], least: int) -> int:
        """The rank for a request whose prompt blocks are ``hashes``: the one of ``fits`` with the longest run
        of them in the index (ties: the less loaded), within ``prefix_slack`` of the least load; else
        ``least``. Its blocks are recorded (most recently used) under the chosen rank, and the leading matched
        blocks that rank has prefilled are expected cached there: its first chunks may exceed the step's prefill
        budget by them (no compute where the rank still holds them; evicted ones are computed in a larger step)."""
        floor = min(loads[u] for u in fits)
        index = self._prefix_index
        best, best_n = least, 0
        for u in fits:
            if loads[u] > floor + self.prefix_slack:
                continue
            n = 0
            while n < len(hashes) and (u, hashes[n]) in index:
                n += 1
            if n > best_n or (n == best_n and n and (loads[u], self._used[u], u) < (loads[best], self._used[best], best)):
                best, best_n = u, n
        self.prefix_routed += best != least
        ready = 0
        while ready < best_n and index[(best, hashes[ready])]:
            ready += 1
        if ready:
            self._expect[s_id] = ready * self.block_size
        self._prompt_blocks[s_id] = (hashes, 0)
        for h in hashes:
            index[(best, h)] = index.get((best, h), False)
            index.move_to_end((best, h))
        while len(index) > self.prefix_index_blocks:
            index.popitem(last=False)
        return best

    def _prefilled(self, s: SeqStatus) -> None:
        """``s``'s rank has now written its prompt blocks below ``s.cached``: marked prefilled in the index."""
        hashes, marked = self._prompt_blocks[s.request_id]
        done = min(len(hashes), s.cached // self.block_size)
        for h in hashes[marked:done]:
            if (s.rank, h) in self._prefix_index:
                self._prefix_index[(s.rank, h)] = True
        if done >= len(hashes):
            del self._prompt_blocks[s.request_id]
        else:
            self._prompt_blocks[s.request_id] = (hashes, max(marked, done))

    def plan(self, ahead: StepPlan | None = None) -> StepPlan:
        """The next step. ``ahead``: a step launched but not committed yet; this plan follows it (its chunks
        count as cached; a sequence it samples continues with a ``deferred`` decode item, unless that sample
        is its last token). Without ``ahead`` the plan follows the committed state."""
        self._admit()
        flying = {it.seq_id: (r, it) for r, its in ahead.items.items() for it in its} if ahead is not None else {}
        items: dict[int, list[WorkItem]] = {r: [] for r in self.ranks}
        budget = {r: self.step_tokens for r in self.ranks}
        running = [s for s in self.seqs.values() if s.state is SeqState.RUNNING]
        steps = self.decode_steps if not self._queue else 1  # a waiting request joins at the next step
        all_decode = True
        # decode tokens first (one each), then prefill chunks within the budget, oldest first
        for s in sorted(running, key=lambda x: (x.cached == 0 and x.request_id not in flying, x.request_id)):
            cached, total, deferred = s.cached, s.length, False
            rank_it = flying.get(s.request_id)
            sampling = 0  # tokens of this sequence being sampled by the step in flight
            if rank_it is not None and rank_it[0] == s.rank:
                it = rank_it[1]
                sampling = ahead.steps if it.sample is not None else 0
                cached = it.start + it.num_tokens + (ahead.steps - 1)
                if it.sample is not None:  # its next tokens are being sampled right now, on its rank
                    if len(s.generated) + sampling >= s.params.max_new_tokens:
                        continue  # those samples reach its last token
                    total, deferred = total + sampling, True
            left = total - cached
            decode = left == 1 and cached > 0
            free = 0 if decode else max(0, self._expect.get(s.request_id, 0) - cached)  # likely cached on its rank
            n = 1 if decode else min(left, max(0, budget[s.rank]) + free)
            if not decode and self.prefix_caching and cached + n < total and self.step_tokens >= self.block_size:
                aligned = (cached + n) // self.block_size * self.block_size  # chunks end on block boundaries
                if aligned > cached:
                    n = aligned - cached
                elif cached % self.block_size == 0:
                    continue  # (the next step's budget reaches the boundary: the oldest prefill goes first)
            if n <= 0:
                continue
            budget[s.rank] -= 0 if decode else n - min(n, free)
            all_decode = all_decode and decode
            left_new = s.params.max_new_tokens - len(s.generated) - sampling
            if left_new < self.decode_steps and not (decode and self._overshoot_fits(s, left_new)):
                steps = min(steps, left_new)  # (else its samples past its last token are dropped at commit)
            if decode and s.params.expert_stats and cached < len(s.prompt):
                steps = 1  # a marked prompt's last token alone: its step's counts are all prompt rows
            end = cached + n
            if free and end >= self._expect[s.request_id]:
                del self._expect[s.request_id]
            spec = self._spec(s, end) if end == total else None
            tokens = () if deferred else s.token_slice(cached, end)
            items[s.rank].append(WorkItem(s.request_id, tokens, cached, spec, decode, deferred,
                                          s.params.penalized, s.params.expert_stats))
        # caches the step in flight already drops stay out of this one (a preempted sequence keeps its id: a
        # second drop would hit its new cache)
        freeing = {x for v in ahead.free.values() for x in v} if ahead is not None else set()
        free = {r: tuple(x for x in v if x not in freeing) for r, v in self._to_free.items()}
        steps = max(1, steps) if all_decode else 1
        return StepPlan(next(self._steps), {r: tuple(v) for r, v in items.items()}, free, steps)

    def _overshoot_fits(self, s: SeqStatus, left_new: int) -> bool:
        """Whether decode sequence ``s``, ``left_new`` tokens from its last, may run the step's ``decode_steps``
        sub-steps anyway (its samples past the last dropped at commit) instead of making the whole step shorter:
        the KV positions those sub-steps write (``decode_steps - left_new - 1`` past its reservation) stay within
        the blocks its reservation already holds and the model's context, and no expert counts are kept for it
        (they count every row). In chat-like traffic some sequence is nearly always one token from its end: at
        b994b30 on an H100 that made 284 of 653 decode steps single sub-steps, each with ~5 ms of device idle."""
        extra = self.decode_steps - left_new - 1
        if s.params.expert_stats:
            return False
        return extra <= 0 or s.reserve_tokens + extra <= min(self.max_context,
                                                              self.blocks(s.reserve_tokens) * self.block_size)

    def _spec(self, s: SeqStatus, position: int) -> SampleSpec:
        """How ``s`` samples its token at ``position``: its parameters, its prompt length (penalties), and while
        fewer than ``min_tokens`` tokens are generated the ids the rank masks (stop ids, and end-of-sequence
        ids unless ``ignore_eos``; a multi-step request's later sub-steps stop masking at the same position)."""
        p = s.params
        suppress, until = (), 0
        if p.min_tokens and position < len(s.prompt) + p.min_tokens:
            until = len(s.prompt) + p.min_tokens
            suppress = tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))))
        return SampleSpec(p.temperature, p.top_p, s.seed, position, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty, len(s.prompt), suppress, until if suppress else 0, p.logprobs,
                          p.logit_bias)

    def commit(self, plan: StepPlan, sampled: Mapping[str, int | Sequence[int]],
               logprobs: Mapping[str, Sequence[TokenLogprobs]] | None = None) -> list[TokenEvent]:
        """Apply a successful step: caches advanced, sampled tokens appended, finished sequences freed.
        sampled: {sequence id: its token}, or for a plan of ``steps`` > 1 the ``steps`` tokens in position
        order (those after its last token, an end of sequence or a stop token are dropped). logprobs: {sequence
        id: one per sampled token} for the requests that asked. An end-of-sequence id ends a sequence unless
        ``ignore_eos``; neither it nor a stop id ends one before ``min_tokens`` tokens (the rank masks them)."""
        for r, names in plan.free.items():
            done = set(names)
            self._to_free[r] = [x for x in self._to_free.get(r, []) if x not in done]
        events = []
        for r, items in plan.items.items():
            for it in items:
                s = self.seqs.get(it.seq_id)
                if s is None or s.state is not SeqState.RUNNING or s.rank != r:
                    continue
                s.cached = it.start + it.num_tokens + (plan.steps - 1)
                if it.seq_id in self._prompt_blocks:
                    self._prefilled(s)
                if it.sample is None:
                    continue
                got = sampled[it.seq_id]
                toks = (got,) if isinstance(got, (int, np.integer)) else tuple(got)
                if len(toks) != plan.steps:
                    raise ValueError(f"sampled[{it.seq_id!r}]: {len(toks)} tokens for a step of {plan.steps} "
                                     f"decode sub-steps")
                lps = (logprobs or {}).get(it.seq_id) or ()
                p = s.params
                for j, tok in enumerate(map(int, toks)):
                    s.generated.append(tok)
                    stops = len(s.generated) > p.min_tokens and (
                        (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids)
                    finished = len(s.generated) >= p.max_new_tokens or stops
                    events.append(TokenEvent(s.request_id, tok, finished, lps[j] if j < len(lps) else None))
                    if finished:
                        self._finish(s)
                        break
        return events

    def _finish(self, s: SeqStatus) -> None:
        """Release its KV reservation (its rank drops the cache with the next step) and move it from the live
        sequences to the bounded finished record (a step already planned for it finds it gone and skips it)."""
        if s.state is SeqState.RUNNING and s.rank in self._used:
            self._used[s.rank] -= self.blocks(s.reserve_tokens)
            self._to_free[s.rank].append(s.request_id)
        s.state = SeqState.FINISHED
        self.seqs.pop(s.request_id, None)
        self._expect.pop(s.request_id, None)
        self._prompt_blocks.pop(s.request_id, None)
        if self.keep_finished:
            self.finished[s.request_id] = s
            self.finished.move_to_end(s.request_id)
            while len(self.finished) > self.keep_finished:
                self.finished.popitem(last=False)


__all__ = ["KvCapacity", "Scheduler", "SeqStatus", "SeqState", "StepPlan", "THIN_KV_TOKENS_PER_SEQUENCE", "TokenEvent",
           "WorkItem"]
