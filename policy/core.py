"""CacheScoutPolicy: the one object a cache (the replay engine, the vLLM connector) talks to.

Per request: `observe` (or `submit` now and `drain` once per step) recognises agent and session,
updates the chain and moves the session; `admit_blocks` files the request's KV blocks under
preamble / anchor / context groups; `finish` closes the call. Per block: `blocks_freed`,
`blocks_reused`, `blocks_evicted`, `block_backed` mirror the cache. Decisions: `evict`/`victims`
(GPU eviction order) and `plan_prefetch`. State for other replicas: `snapshot`/`absorb`.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Final

from .config import PolicyConfig
from .costs import RebuildCost
from .errors import ConfigError
from .eviction import Block, EvictionIndex, Group
from .fingerprint import AgentFingerprinter, Fingerprint
from .guard import LruGuard
from .prefetch import Locate, PrefetchAction, PrefetchCandidate, PrefetchPlanner
from .scorer import WANTED_MODEL, SurvivalScorer
from .sessions import Session, SessionTracker
from .state import TransitionSnapshot
from .traffic import Traffic
from .transitions import END, START, LearnerRef, TransitionLearner

HINT_KEYS = {"agent": "cachescout.agent", "session": "cachescout.session_id", "next_agent": "cachescout.next_agent"}
_MAX_HINT_LEN: Final = 256
SHARED_NAME_PREFIX = "anchor-"   # agents' names in the shared state (`shared_names`)
_RESAMPLE_AFTER: Final = 64      # requests after which the guard's sampling is set by their size
# Prefetch precision: prefetched blocks used before eviction, decayed per block judged. Below the
# bar (one in two), a wrong prefetch (a displaced block that may need a recompute) costs more than a
# right one saves (a load's latency): prefetch only one planning round in `_PREFETCH_PROBE`, so a
# change in the traffic is still seen.
_PREFETCH_DECAY: Final = 0.99
_PREFETCH_JUDGED: Final = 32.0     # decayed blocks judged before the bar applies
_PREFETCH_MIN_PRECISION: Final = 0.5
_PREFETCH_PROBE: Final = 64
_PREFETCH_PENDING_MAX: Final = 1 << 16
_WANTED_STEP: Final = 1e-9    # `model` between the groups of two requests queued one after the other
_SPENT_MEMORY: Final = 1 << 16  # evicted spent blocks remembered, to count those computed again


def output_ending(output_tokens: Sequence[int]) -> tuple[int, ...] | None:
    """The `ending` of a call (see `CacheScoutPolicy.finish`) read from its output: its last two
    token ids. In most chat templates they tell a tool call (closing markup, or a stop token of its
    own such as Llama 3's end-of-message) from an answer to a person (end of turn), and so the
    seconds a tool takes from the minutes a person does."""
    return tuple(output_tokens[-2:]) if output_tokens else None


def _free_order(b: Block) -> int:
    return b.seq


@dataclasses.dataclass(frozen=True, slots=True)
class Hints:
    """What an agent framework may tell us explicitly (through vLLM's `kv_transfer_params`)."""

    agent: str | None = None
    session: str | None = None
    next_agent: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> tuple[Hints | None, list[str]]:
        """Parse hints from request parameters; malformed values are dropped and reported."""
        if not params:
            return None, []
        values: dict[str, str] = {}
        bad: list[str] = []
        for field, key in HINT_KEYS.items():
            v = params.get(key)
            if v is None:
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            if isinstance(v, str) and 0 < len(v) <= _MAX_HINT_LEN:
                values[field] = v
            else:
                bad.append(key)
        return (cls(**values) if values else None), bad


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """What the policy concluded about one request."""

    request_id: Hashable
    agent: str | None
    session: Hashable
    previous_agent: str | None
    new_session: bool
    session_evidence: str
    predicted_agent: str | None      # the chain's top guess for this call, made before seeing it
    fingerprint: Fingerprint


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyInternals:
    """The policy's components, for tests and the microbench to read (`CacheScoutPolicy.inspect`).
    Nothing on the serving path goes through it; a test that sets up a state through it says so."""

    learner: TransitionLearner
    fingerprints: AgentFingerprinter
    sessions: SessionTracker
    index: EvictionIndex
    scorer: SurvivalScorer
    traffic: Traffic
    guard: LruGuard
    planner: PrefetchPlanner
    cost: RebuildCost


@dataclasses.dataclass(slots=True)
class _Live:
    obs: Observation
    started_at: float
    context: Group | None = None   # the group its context blocks go to (looked up once)
    blocks: int = 0                # blocks it holds so far (prompt and output): the next one's position


class CacheScoutPolicy:
    def __init__(self, config: PolicyConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 max_pending: int = 4096) -> None:
        self.cfg = cfg = config or PolicyConfig()
        self.clock = clock
        self._chain = LearnerRef(TransitionLearner(cfg.transition_half_life, cfg.confidence_count_scale))
        self._fingerprints = AgentFingerprinter(cfg)
        self._sessions = SessionTracker(cfg)
        self._cost = RebuildCost(cfg)
        self._index = EvictionIndex()
        self._traffic = Traffic()
        self._scorer = SurvivalScorer(cfg, self._chain, self._sessions, self._cost, self._traffic)
        self._planner = PrefetchPlanner(cfg, self._cost)
        self._guard = LruGuard(per_depth=self._cost.per_depth, backed_value=self._cost.backed_value("cpu"))
        self._prefetched: dict[Hashable, None] = {}   # prefetched blocks not yet used or evicted
        self._prefetch_used = 0.0                      # decayed counts of those judged
        self._prefetch_judged = 0.0
        self._prefetch_rounds = 0
        self._live: dict[Hashable, _Live] = {}
        # Cached blocks queued requests (observed, not yet admitted) will hit: key -> [the group it
        # came from, then the groups of the requests that want it, earliest first]; request -> (its
        # number, its group, the keys it wants); requests queued so far.
        self._wanted: dict[Hashable, list[Group]] = {}
        self._wanting: dict[Hashable, tuple[int, Group, list[Hashable]]] = {}
        self._queued = 0
        self._aliases: dict[str, str] = {}        # inferred agent id -> hinted name for it
        self._next_hint: dict[Hashable, str] = {}  # session -> agent it will call next (hinted)
        self._pending: deque = deque()
        self._overdue_at = float("-inf")
        # Session -> agent -> block keys of its latest prompt (and output) under that agent: what
        # its next call to that agent reuses, for context prefetch.
        self._context_keys: dict[Hashable, dict[str, list]] = {}
        # Spent blocks evicted lately (oldest first): one computed again was used after all.
        self._spent_gone: OrderedDict[Hashable, None] = OrderedDict()
        self._max_pending = max_pending
        self._prompt_blocks = 0    # blocks and requests admitted, until the guard's sampling is set
        self._admitted = 0
        self.stats: Counter[str] = Counter()

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request_id: Hashable, block_hashes: Sequence[int], *, tokens: Sequence[int] | None = None,
               hints: Hints | None = None, now: float | None = None) -> bool:
        """Queue a request for the next `drain` (O(1)); False if the queue is full (counted, dropped)."""
        if len(self._pending) >= self._max_pending:
            self.stats["dropped_events"] += 1
            return False
        self._pending.append((request_id, block_hashes, tokens, hints, self.clock() if now is None else now))
        return True

    def drain(self) -> list[Observation]:
        out = []
        while self._pending:
            rid, hashes, tokens, hints, now = self._pending.popleft()
            out.append(self.observe(rid, hashes, tokens=tokens, hints=hints, now=now))
        return out

    def observe(self, request_id: Hashable, block_hashes: Sequence[int], *, tokens: Sequence[int] | None = None,
                hints: Hints | None = None, now: float | None = None,
                content: Sequence[Sequence[int]] | None = None) -> Observation:
        """Recognise a new request's agent and session and learn from it.

        `tokens`: the prompt's token ids (inside vLLM); or `content`: its `content_sketch`
        (trace files carry that instead of tokens). Either lets calls be linked into sessions."""
        now = self.clock() if now is None else now
        self._expire(now)
        fp = self._fingerprints.observe(block_hashes)
        for gone in self._fingerprints.retired:
            self._chain.learner.forget(self._aliases.pop(gone, gone))
        self._fingerprints.retired.clear()

        agent = fp.agent
        if agent is not None:
            agent = self._aliases.get(agent, agent)
        if hints is not None and hints.agent is not None:
            if fp.agent is not None and self._aliases.get(fp.agent) != hints.agent:
                self._aliases[fp.agent] = hints.agent
            agent = hints.agent
        # The session's own content starts where this prompt stops matching anything seen before
        # (past the anchor, and past task text other sessions repeated).
        bs = self.cfg.block_size
        own_start = fp.anchor_blocks if fp.agent else fp.preamble_blocks
        start = max(own_start, fp.matched_blocks) * bs
        a = self._sessions.assign(now, agent, hint=hints.session if hints else None, continues=fp.continues,
                                 candidates=fp.candidates, tokens=tokens, sketch=content, content_start=start)
        s = a.session
        if fp.matched_blocks > own_start and a.evidence != "continuation":
            # Past the anchor, this prompt repeats what another session sent (the same task text):
            # that text is no evidence for either session.
            self._sessions.mark_shared(own_start * bs, start, tokens=tokens, sketch=content)
        traffic = self._traffic
        traffic.call_opened(now, a.new, a.previous_call_at)
        if not a.new and s.last_finish_at and s.in_flight == 1:
            if a.previous_agent is not None:
                traffic.waited(a.previous_agent, now - s.last_finish_at)
            else:
                traffic.waits.waited(s.ending, now - s.last_finish_at)

        src = START if a.new else a.previous_agent
        predicted = None
        if src is not None:
            learner = self._chain.learner
            probs = learner.probabilities(src)
            if probs:
                predicted = max(probs.items(), key=lambda kv: (kv[1], kv[0]))[0]
            if agent is not None:
                self.stats["predictions"] += 1
                self.stats["predictions_correct"] += predicted == agent
                learner.update(src, agent)
        self._fingerprints.set_owner(fp.leaf, s.sid, fp.continues)
        if agent is not None and fp.agent is not None:
            traffic.anchor_in_use(agent, fp.anchor_node)
            s.anchor_nodes[agent] = fp.anchor_node
        if hints is not None and hints.next_agent is not None:
            self._next_hint[s.sid] = hints.next_agent
        else:
            self._next_hint.pop(s.sid, None)
        obs = Observation(request_id, agent, s.sid, a.previous_agent, a.new, a.evidence, predicted, fp)
        self._live[request_id] = _Live(obs, now, None)
        self._want(request_id, block_hashes)
        self.stats["requests"] += 1
        if self.stats["requests"] % 512 == 0:
            self._index.prune_groups()
            for live in self._live.values():
                live.context = None   # may have been pruned: look it up again
        self.stats["recognised"] += agent is not None
        return obs

    def finish(self, request_id: Hashable, now: float | None = None,
               output_tokens: Sequence[int] | None = None, output_chunks: Sequence[int] | None = None,
               ending: Hashable | None = None) -> None:
        """The request's call ended (its blocks are released separately, by `blocks_freed`).
        `output_tokens` (or their precomputed `output_chunks`) help recognise the session of the
        call that uses them next. `ending`: a small hashable signature of how the call ended (its
        last output token ids, a stop reason), or None: sessions without a known agent are
        expected to call again after the waits learned for that ending (a tool call is answered
        in seconds, an answer to a person in minutes or never)."""
        live = self._live.pop(request_id, None)
        if request_id in self._wanting:   # it ended (was aborted) before it was admitted
            self._guard.unwanted(*self._unwant(request_id, admitted=False), refresh=False)
        if live is not None:
            now = self.clock() if now is None else now
            self._traffic.call_took(live.obs.agent, now - live.started_at)
            self._sessions.finished(live.obs.session, now, output_tokens, output_chunks, ending)

    def observation(self, request_id: Hashable) -> Observation | None:
        live = self._live.get(request_id)
        return None if live is None else live.obs

    def _expire(self, now: float) -> None:
        for s in self._sessions.expire(now, self._traffic.known_step_s()):
            if s.agent is None and s.in_flight == 0:
                self._traffic.waits.gave_up(s.ending)
            self._next_hint.pop(s.sid, None)
            self._context_keys.pop(s.sid, None)
            self._note_dead(s)
            if s.agent is not None and not s.over:
                self._chain.learner.update(s.agent, END)
        # A session idle far past its agent's usual wait has most likely ended: the chain learns
        # that now (the session is kept until it expires, in case it calls again after all).
        if now - self._overdue_at >= self.cfg.rescore_interval_s:
            self._overdue_at = now
            patience, shortest = self._scorer.patience()
            for s in self._sessions.overdue(now, patience, shortest):
                if s.agent is not None:
                    self._chain.learner.update(s.agent, END)

    def _note_dead(self, s: Any) -> None:
        """Session `s` expired: its contexts' blocks are presumed dead from now on (counted, to
        learn how often such blocks are hit again after all)."""
        blocks = 0
        for agent in (None, *s.called):
            g = self._index.get_group(("ctx", s.sid, agent))
            if g is not None:
                blocks += g.n_blocks
                g.last_call = None   # no next call to compare with
        if blocks:
            self._traffic.contexts_expired(blocks)

    def _note_dead_hits(self, block_keys: Sequence[Hashable], num_cached: int) -> None:
        """Hits on blocks of expired sessions' contexts (deepest first: they follow their prefix)."""
        index, get = self._index, self._sessions.get
        reused = 0
        for i in range(num_cached - 1, -1, -1):
            b = index.block(block_keys[i])
            if b is None:
                break
            g = b.group
            if g.kind != "context" or get(g.session) is not None:
                break
            reused += 1
        if reused:
            self._traffic.expired_contexts_hit(reused)

    # -- queued requests -----------------------------------------------------------------------
    def _want(self, request_id: Hashable, block_keys: Sequence[Hashable]) -> None:
        """A request is queued: the cached prefix of its prompt will be hit when it is admitted,
        which is not a prediction, and the cached blocks past a missing one (recomputed, since a hit
        stops there) are what the session's next call will hit once this one fills the gap. On a
        loaded server LRU evicts such blocks while the request waits (2-4% of all prompt blocks of
        long conversations). They move to a group of the request's own, evicted after every other
        free block whatever the model says or the guard trusts: the latest queued request's first
        (the queue admits the earliest first), each request's in free order. A block two queued
        requests want stays with the earlier one."""
        index = self._index
        got: list[Hashable] = []
        blocks: list[Block] = []
        for key in block_keys:
            b = index.block(key)
            if b is not None:
                got.append(key)
                blocks.append(b)
        if not got:
            return
        self._queued += 1
        group = index.group(("wanted", self._queued), "wanted")
        # Later requests' groups go first: a larger `model`, all of them below any prediction's.
        group.model, group.conf = WANTED_MODEL + self._queued * _WANTED_STEP, 1.0
        wanted = self._wanted
        # In free order (a prompt's blocks were freed tail first): each lands at its group's tail.
        for b in sorted(blocks, key=_free_order):
            w = wanted.get(b.key)
            if w is None:
                wanted[b.key] = [b.group, group]
                index.assign(b, group)
            else:
                w.append(group)
        self._wanting[request_id] = (self._queued, group, got)
        self._guard.wanted(got, self._queued)

    def _unwant(self, request_id: Hashable, admitted: bool) -> tuple[list[Hashable], int]:
        """The queued request was admitted (or ended): its blocks go to the next queued request
        that wants them, else back to their groups. Admitted, those of its blocks it did not hit
        (cached past a missing block) are its session's latest prompt all the same, used again by
        the session's next call: they count as freed now (vLLM's LRU would leave them where they
        were, the oldest). Returns the keys it wanted and its number (for the guard)."""
        number, group, keys = self._wanting.pop(request_id)
        index = self._index
        wanted = self._wanted
        back: list[tuple[Block, Group]] = []
        for key in keys:
            w = wanted.get(key)
            if w is None:
                continue
            w.remove(group)
            b = index.block(key)
            if len(w) > 1:
                if b is not None and b.group is group:
                    index.assign(b, w[1])
                continue
            del wanted[key]
            if b is not None and b.group is group:
                back.append((b, w[0]))
        back.sort(key=lambda t: t[0].seq)
        for b, home in back:
            index.assign(b, index.registered(home))
        if admitted:
            fresh = [b.key for b, _ in back if b.free]
            if fresh:
                index.acquire(fresh)
                index.release(fresh, self.clock())
        return keys, number

    def _keep_wanted(self, block_keys: Sequence[Hashable]) -> None:
        """Blocks just filed under an admitted request's groups that another queued request still
        wants: back to that request's group; the admitted request's group is where they go after."""
        index = self._index
        wanted = self._wanted
        for key in block_keys:
            w = wanted.get(key)
            if w is None:
                continue
            b = index.block(key)
            if b is not None and b.group is not w[1]:
                w[0] = b.group
                index.assign(b, w[1])

    # -- KV blocks of the GPU tier ------------------------------------------------------------
    def admit_blocks(self, request_id: Hashable, block_keys: Sequence[Hashable], num_cached: int,
                     hittable: Sequence[Hashable] | None = None) -> None:
        """The request holds `block_keys` (prompt order); the first `num_cached` were prefix hits.
        `hittable`: the prompt's blocks a hit may cover (its full blocks, less the last one when the
        prompt ends on a block boundary: vLLM always computes the last token), for the LRU guard's
        comparison; default `block_keys`."""
        wanted = self._unwant(request_id, admitted=True) if request_id in self._wanting else None
        live = self._live.get(request_id)
        index = self._index
        self._prompt_blocks += len(block_keys)
        self._admitted += 1
        if self._admitted == _RESAMPLE_AFTER:
            self._guard.resample(self._prompt_blocks / self._admitted)
        self._guard.accessed(block_keys, num_cached, None if hittable is None else len(hittable))
        if wanted:
            # After the access: the real cache made room for this request while its blocks were kept.
            self._guard.unwanted(*wanted, refresh=True)
        if num_cached:
            self._note_dead_hits(block_keys, num_cached)
        n = len(block_keys)
        gone = self._spent_gone
        used_spent = 0
        if live is None:
            for i in range(num_cached, n):
                key = block_keys[i]
                if gone and key in gone:
                    del gone[key]
                    used_spent += 1
                index.add(key, None, i)
            used_spent += index.acquire(block_keys[:num_cached])
            if used_spent:
                self._traffic.spent_used(used_spent)
            return
        pre, anc, ctx = self._groups_for(live.obs)
        pre_end = min(live.obs.fingerprint.preamble_blocks, n) if pre is not None else 0
        anc_end = min(live.obs.fingerprint.anchor_blocks, n) if anc is not None else pre_end
        anc_end = max(anc_end, pre_end)
        if not live.blocks:   # not again after a preemption: its own blocks are no earlier call's
            self._spend(ctx, block_keys, anc_end)
        live.blocks = n
        live.context = ctx
        spans = ((0, pre_end, pre), (pre_end, anc_end, anc), (anc_end, n, ctx))
        for lo, hi, group in spans:
            if lo >= hi or group is None:
                continue
            hit_hi = min(hi, num_cached)
            # Hits are usually filed already: check the span's ends before walking it (a block
            # prefetched from a lower tier came without its position).
            if lo < hit_hi:
                b_lo, b_hi = index.block(block_keys[lo]), index.block(block_keys[hit_hi - 1])
                if (b_lo is None or b_hi is None or b_lo.group is not group or b_hi.group is not group
                        or b_hi.depth < hit_hi - 1):
                    for i in range(lo, hit_hi):
                        index.add(block_keys[i], group, i)
            for i in range(max(lo, num_cached), hi):
                key = block_keys[i]
                if gone and key in gone:
                    del gone[key]
                    used_spent += 1
                index.add(key, group, i)
        ctx.last_call = call = list(block_keys)
        ctx.last_prompt = n
        if self._wanted:
            self._keep_wanted(block_keys)
        used_spent += index.acquire(block_keys[:num_cached])
        if used_spent:
            self._traffic.spent_used(used_spent)
        if live.obs.agent is not None:   # the same list: prefetch keeps it while the group is pruned
            contexts = self._context_keys.setdefault(live.obs.session, {})
            contexts[live.obs.agent] = call

    def extend_blocks(self, request_id: Hashable, block_keys: Sequence[Hashable]) -> None:
        """Blocks the request filled while decoding (its output): filed with its context, or as
        spent where contexts' next calls have been seen not to carry their outputs."""
        live = self._live.get(request_id)
        group = None
        if live is not None:
            group = live.context
            if group is None:
                group = live.context = self._groups_for(live.obs)[2]
            # The call's keys, held by its context group and (for an agent's context) by prefetch:
            # one list, or the prefetch's alone where the group was pruned and made again.
            keys = group.last_call
            if keys is None and live.obs.agent is not None:
                keys = self._context_keys.get(live.obs.session, {}).get(live.obs.agent)
            if keys is not None:
                keys.extend(block_keys)
        home = group
        spent = group is not None and self._traffic.outputs_carried() is False
        if spent:
            home = self._index.spent_group
            self._traffic.blocks_spent(len(block_keys))
        add = self._index.add
        at = live.blocks if live is not None else 0
        for i, key in enumerate(block_keys):
            add(key, home, at + i).spent = spent
        if live is not None:
            live.blocks = at + len(block_keys)
        self._guard.filled(block_keys)

    def _spend(self, ctx: Group, block_keys: Sequence[Hashable], start: int) -> None:
        """A call of context `ctx` holds `block_keys`: the blocks of the context's previous call
        that it left out (past where the two prompts part: an edited, compacted or rewound
        conversation, an output that came back re-rendered) are spent. Where under half of the
        spent blocks counted so far were used again after all, they go to the spent group, scored
        by that share (usually about none: then they leave before anything still in use); where
        more come back, they stay with their context and its prediction, and are only counted.
        Only where the call goes on with the context: it shares a block past `start` (where its
        context begins) with the previous call; a call that shares no more than the anchor is
        another conversation taken for this session (content matched wrongly), or one started
        afresh, and tells nothing of what the previous call left. Also measures whether a call
        carries its previous call's output as it was generated (whose blocks then hit)."""
        prev = ctx.last_call
        if prev is None:
            return
        # Where the prompts part: chained keys agree at position i only if they agree before it.
        lo, hi = 0, min(len(prev), len(block_keys))
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if prev[mid - 1] == block_keys[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        parted = lo
        if parted <= start:
            return
        if len(prev) > ctx.last_prompt:
            self._traffic.outputs_checked(len(prev) - ctx.last_prompt, max(0, parted - ctx.last_prompt))
        index = self._index
        apart = self._traffic.spent_set_apart()
        spent = index.spent_group
        left = 0
        for i in range(parted, len(prev)):
            b = index.block(prev[i])
            if b is not None and b.group is ctx and not b.spent:
                b.spent = True
                if apart:
                    index.assign(b, spent)
                left += 1
        if left:
            self._traffic.blocks_spent(left)

    def _note_spent_evicted(self) -> None:
        evicted = self._index.spent_evicted
        if not evicted:
            return
        gone = self._spent_gone
        for key in evicted:
            gone[key] = None
        evicted.clear()
        while len(gone) > _SPENT_MEMORY:
            gone.popitem(last=False)

    def _groups_for(self, obs: Observation) -> tuple[Group | None, Group | None, Group]:
        fp = obs.fingerprint
        index = self._index
        pre = index.group(("pre", fp.preamble_node), "preamble") if fp.preamble_blocks else None
        anc = None
        if obs.agent is not None and fp.agent is not None and fp.anchor_blocks > fp.preamble_blocks:
            anc = index.group(("anchor", obs.agent, fp.anchor_node), "anchor", agent=obs.agent, parent=pre)
        ctx = index.group(("ctx", obs.session, obs.agent), "context", agent=obs.agent, session=obs.session,
                          parent=anc or pre)
        return pre, anc, ctx

    def blocks_prefetched(self, keys: Sequence[Hashable], agent: str | None, now: float | None = None,
                          session: Hashable | None = None) -> None:
        """Blocks a prefetch brought into this tier (cached and free): `agent`'s anchor, or with
        `session` that session's context under `agent`. Blocks already filed keep their group."""
        group = None
        if session is not None:
            group = self._index.get_group(("ctx", session, agent))
        elif agent is not None:
            rec = self._fingerprints.agent({v: k for k, v in self._aliases.items()}.get(agent, agent))
            if rec is not None and rec.anchor_node:
                group = self._index.get_group(("anchor", agent, rec.anchor_node))
        pending = self._prefetched
        self._guard.loaded(keys)
        for key in keys:
            self._index.add(key, group)
            if len(pending) < _PREFETCH_PENDING_MAX:
                pending[key] = None
        self._index.release(keys, self.clock() if now is None else now)

    def _judge_prefetch(self, keys: Sequence[Hashable], used: bool) -> None:
        pending = self._prefetched
        for key in keys:
            if key in pending:
                del pending[key]
                self._prefetch_used = self._prefetch_used * _PREFETCH_DECAY + (1.0 if used else 0.0)
                self._prefetch_judged = self._prefetch_judged * _PREFETCH_DECAY + 1.0

    def prefetch_precision(self) -> float | None:
        """The decayed share of prefetched blocks used before they were evicted (None: too few yet)."""
        if self._prefetch_judged < _PREFETCH_JUDGED:
            return None
        return self._prefetch_used / self._prefetch_judged

    def blocks_freed(self, keys: Sequence[Hashable], now: float | None = None) -> None:
        """Blocks whose reference count dropped to zero (still cached, now evictable)."""
        self._index.release(keys, self.clock() if now is None else now)
        self._guard.released(keys)

    def blocks_reused(self, keys: Sequence[Hashable]) -> None:
        """Free cached blocks a request hit: no longer evictable."""
        spent = self._index.acquire(keys)
        if spent:
            self._traffic.spent_used(spent)
        if self._prefetched:
            self._judge_prefetch(keys, True)

    def prefetch_hits(self, keys: Sequence[Hashable]) -> None:
        """A call hit these blocks (they are admitted by `admit_blocks` as usual): those that came
        in by a prefetch count as used. For a cache that does not call `blocks_reused` on hits."""
        if self._prefetched:
            self._judge_prefetch(keys, True)

    def blocks_evicted(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self._index.discard(key)
        self._note_spent_evicted()
        self._guard.evicted(keys)
        if self._prefetched:
            self._judge_prefetch(keys, False)

    def block_backed(self, key: Hashable, backed: bool = True) -> None:
        """A lower tier now holds (or lost) a copy of this block."""
        self._index.set_backed(key, backed)
        self._guard.backed(key, backed)

    # -- decisions ----------------------------------------------------------------------------
    def victims(self, n: int, now: float | None = None) -> list[Hashable]:
        """The next `n` free blocks to evict, coldest first. Reads state only."""
        now = self.clock() if now is None else now
        self._scorer.score(self._index, self._next_hint, self._guard.trust, now)
        return self._index.victims(n, now)

    def evict(self, n: int, now: float | None = None) -> list[Hashable]:
        """Remove and return the next `n` victims."""
        now = self.clock() if now is None else now
        self._scorer.score(self._index, self._next_hint, self._guard.trust, now)
        out = self._index.evict(n, now)
        self._note_spent_evicted()
        self._guard.evicted(out)
        if self._prefetched:
            self._judge_prefetch(out, False)
        return out

    def confidence(self) -> float:
        return self._scorer.confidence()

    def next_agent_probabilities(self, counts: Mapping[str, float] | None = None) -> dict[str, tuple[float, float]]:
        """Per agent (by its hinted name where it has one): (probability that a live or arriving
        session calls it next, the model's confidence in that); hinted next agents are certain.
        The confidence carries the guard's trust: where acting on the model loses to LRU, nothing
        built on its predictions (prefetches, the CPU tier's ranking) acts either. `counts`: the
        sessions counted per current agent (default: all live ones)."""
        trust = self._guard.trust
        probs = self._scorer.next_call_probabilities(counts)
        if trust < 1.0:
            probs = {a: (p, conf * trust) for a, (p, conf) in probs.items()}
        for nxt in self._next_hint.values():
            probs[nxt] = (1.0, 1.0)   # the framework said so
        return probs

    def plan_prefetch(self, locate: Locate, inflight_bytes: int = 0, now: float | None = None) -> list[PrefetchAction]:
        """Prefetch actions for the anchors and session contexts the next calls most likely need
        (see prefetch.py)."""
        now = self.clock() if now is None else now
        if not self.prefetch_round():
            return []
        # Only the calls expected within `prefetch_lead_s` are prefetched for, anchors and
        # contexts alike: a block brought to the GPU long before its call displaces blocks for
        # longer and is more likely evicted unused (a conversation idle for minutes is no reason
        # to bring its agent's anchor back now).
        soon: list[tuple[Session, str, float]] = []
        soon_counts: dict[str, float] = {}
        for s in self._sessions:
            if s.agent is None:
                continue
            t_next, alive = self._scorer.next_call_in(s, now)
            if t_next <= self.cfg.prefetch_lead_s and alive >= 0.5:
                soon.append((s, s.agent, alive))
                soon_counts[s.agent] = soon_counts.get(s.agent, 0.0) + alive
        probs = self.next_agent_probabilities(soon_counts)
        inverse = {v: k for k, v in self._aliases.items()}
        candidates = []
        for agent, (p, conf) in probs.items():
            rec = self._fingerprints.agent(inverse.get(agent, agent))
            if rec is not None and rec.anchor_blocks:
                candidates.append(PrefetchCandidate(agent, p, rec.anchor_path, conf))
        # Contexts: a session about to call again will reuse its context under its next agent.
        # A context prefetched from the CPU tier saves only its load time, while a block it
        # displaces may cost a recompute: a context takes only room the eviction order would
        # give up before its own blocks still cached (`_room_below`).
        link = self._scorer.session_links()
        # Scored every round, as eviction will see them (whether or not a context is a candidate:
        # scores are computed once per rescoring tick, at the first call in it).
        self._scorer.score(self._index, self._next_hint, self._guard.trust, now)
        dead: int | None = None
        profile: tuple[list[float], list[int]] | None = None
        for s, current, alive in soon:
            contexts = self._context_keys.get(s.sid)
            if not contexts or s.in_flight:
                continue
            hinted = self._next_hint.get(s.sid)
            _, conf = self._scorer.row(current)
            for agent, keys in contexts.items():
                p = 1.0 if hinted == agent else self._chain.learner.probability(current, agent) * alive
                c = 1.0 if hinted == agent else conf * link * self._guard.trust
                if p >= self.cfg.prefetch_min_probability:
                    if profile is None:
                        dead = self.dead_room(now)
                        profile = self._index.eviction_profile(now)
                    room = self._room_below(s.sid, agent, dead, profile, now)
                    candidates.append(PrefetchCandidate(agent, p, keys, c, s.sid, room))
        return self._planner.plan(candidates, locate, inflight_bytes)

    def _room_below(self, sid: Hashable, agent: str, dead: int | None,
                    profile: tuple[list[float], list[int]], now: float) -> int | None:
        """Blocks a prefetch of session `sid`'s context under `agent` may take: the free blocks
        the eviction order gives up before the context's own blocks still cached (the model,
        priced by what losing each costs, values them less), at least the room predicted dead;
        only that where none of the context is cached and free, or it is on LRU's order. None:
        nothing is free (the room is empty blocks)."""
        if dead is None:
            return None
        g = self._index.get_group(("ctx", sid, agent))
        key = self._index.head_key(g, now) if g is not None and g.conf > 0 else None
        if key is None:
            return dead
        negated, cumulative = profile
        i = bisect.bisect_left(negated, -key)
        return max(dead, cumulative[i - 1] if i else 0)

    def prefetch_round(self) -> bool:
        """Whether a round of prefetching may act: always while the prefetches judged so far were
        mostly used; below one in two used, one round in `_PREFETCH_PROBE` (so that a change in
        the traffic is still seen). Counts the round."""
        precision = self.prefetch_precision()
        self._prefetch_rounds += 1
        return precision is None or precision >= _PREFETCH_MIN_PRECISION or not self._prefetch_rounds % _PREFETCH_PROBE

    def room_is_dead(self, now: float | None = None) -> bool:
        """Whether the next block evicted belongs to a group the model predicts is never used
        again (or nothing is evictable): room a prefetch may take without costing a likely hit."""
        now = self.clock() if now is None else now
        self._scorer.score(self._index, self._next_hint, self._guard.trust, now)
        victim = self._index.next_victim_group(now) if self._index.n_free else None
        return victim is None or (victim.conf > 0 and victim.model >= self._scorer.dead_model - 1e-9)

    def dead_room(self, now: float | None = None) -> int | None:
        """How many blocks a prefetch may take without costing a likely hit: the free blocks of
        groups the model predicts are never used again (None when nothing is free: the room is
        empty blocks, as many as the cache has)."""
        now = self.clock() if now is None else now
        self._scorer.score(self._index, self._next_hint, self._guard.trust, now)
        dead = self._scorer.dead_model - 1e-9
        free = 0
        room = 0
        for g in self._index.free_groups():
            free += g.n_free
            if g.conf > 0 and g.model >= dead:
                room += g.n_free
        return room if free else None

    def predict_next(self, agent: str) -> list[tuple[str, float]]:
        """The chain's distribution of the agent called after `agent`, most likely first."""
        return sorted(self._chain.learner.probabilities(agent).items(), key=lambda kv: (-kv[1], kv[0]))

    # -- what the connector and the shared state read -----------------------------------------
    @property
    def order_version(self) -> int:
        """Moves whenever the eviction order may have changed; between two reads that agree only
        time has passed (a placement of victims may stand)."""
        return self._index.version

    @property
    def rescore_epoch(self) -> int:
        """Moves with every rescoring (the agents' scores may have changed)."""
        return self._index.epoch

    @property
    def names_version(self) -> int:
        """Moves whenever an anchor was learned or changed (`shared_names` may then differ)."""
        return self._fingerprints.anchors_version

    @property
    def half_life(self) -> float:
        """The learned chain's half-life in updates (`transition_half_life`)."""
        return self._chain.learner.half_life

    def set_journal(self, journal: Callable[[tuple], None] | None) -> None:
        """Report every change of the learned chain to `journal` (one tuple per change, on the
        caller's thread; `TransitionLearner.replay` applies one). It stays on across
        `install_learner`."""
        self._chain.learner.journal = journal

    def learn_transition(self, src: str, dst: str) -> None:
        """Teach the chain that `dst` followed `src` (what `observe` does for a recognised call):
        for tools that seed a model, and tests."""
        self._chain.learner.update(src, dst)

    def transitions(self) -> list[tuple[str, str, float]]:
        """The learned chain's edges (source, destination, decayed count)."""
        return list(self._chain.learner.edges())

    def guard_counters(self) -> dict[str, int]:
        """The LRU guard's cumulative counts (guard.py `counters`): how the eviction order is doing
        against plain LRU on this traffic, for metrics."""
        return self._guard.counters()

    def inspect(self) -> PolicyInternals:
        """The components as they are now, for tests and the microbench (see `PolicyInternals`)."""
        return PolicyInternals(self._chain.learner, self._fingerprints, self._sessions, self._index, self._scorer,
                               self._traffic, self._guard, self._planner, self._cost)

    # -- shared state -------------------------------------------------------------------------
    def snapshot(self) -> TransitionSnapshot:
        return TransitionSnapshot.of(self._chain.learner)

    def absorb(self, snapshot: TransitionSnapshot) -> None:
        """Add another replica's learned counts to the model used for predictions."""
        if snapshot.half_life != self._chain.learner.half_life:
            raise ConfigError(f"snapshot half_life {snapshot.half_life} differs from this policy's "
                             f"transition_half_life {self._chain.learner.half_life}")
        self._chain.learner.absorb(snapshot.decayed_rows())

    def shared_names(self) -> dict[str, str]:
        """Local agent name -> the name every replica gives that agent, for the shared state.

        A recognised agent's local name depends on what this replica saw first (a prompt seen
        before the shared preamble was known is named by the preamble's first block), so replicas
        can name one agent differently. The chained hash of the agent's first block past the
        preamble depends only on the prompts' content. Two local agents on one name (the
        preamble not learned yet) are ambiguous and left out; so are hinted names (already shared)."""
        out: dict[str, str] = {}
        owners: dict[str, int] = {}
        for rec in self._fingerprints.agents():
            if rec.agent_id in self._aliases or not rec.private_key:
                continue
            name = f"{SHARED_NAME_PREFIX}{rec.private_key & (2**64 - 1):016x}"
            out[rec.agent_id] = name
            owners[name] = owners.get(name, 0) + 1
        return {local: name for local, name in out.items() if owners[name] == 1}

    def install_learner(self, learner: TransitionLearner) -> None:
        """Predict from `learner` from now on (a merged model built off the serving path).

        The journal hook moves over, and the version jumps so every cached prediction is redone.
        """
        if learner.half_life != self._chain.learner.half_life:
            raise ConfigError(f"learner half_life {learner.half_life} differs from this policy's "
                             f"transition_half_life {self._chain.learner.half_life}")
        learner.version = self._chain.learner.version + self.cfg.model_refresh_interval + 1
        learner.journal = self._chain.learner.journal
        self._chain.learner = learner
