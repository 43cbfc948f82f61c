"""Recognise which agent a request belongs to from its prompt's chained block hashes alone.

Every prompt is a path in a compressed radix tree over block hashes. Because vLLM's block hashes are
chained (a block's hash covers the whole prefix up to it), two prompts share a prefix of length d
exactly when their hashes at position d-1 are equal, so finding where a prompt leaves an edge is a
binary search, and a walk costs O(branch points on the path x log edge length).

Vocabulary:
- support: decayed count of requests that went through a node (half-life in requests).
- shared prefix: a branch point (two or more continuations seen) carried by enough requests
  (at least `fingerprint_min_support` and `fingerprint_min_share` of recent traffic). Agent anchors
  are shared prefixes; so are framework headers and versions of an anchor.
- preamble: a shared prefix below which at least two shared prefixes are active and together carry
  most of its traffic (a framework header several agents start with), and sessions show it: they
  move between its children (one workflow calls several agents), or many sessions go into each
  child (an agent serves many workflows). Task text that several sessions repeat under one agent
  makes shared prefixes too, but there each session goes into a child of its own. Without session
  evidence, a preamble is one whose traffic is concentrated on at most 16 children. (An agent whose
  whole traffic is a handful of identical task texts looks like that many agents; hints resolve it.)
- agent key: the hash of the first block after the deepest preamble on the path (the root is the
  preamble of agents that share nothing). An anchor that changes near its end (a tool appended) keeps
  that block, so it keeps its agent once its old version stops receiving traffic.
- anchor: the shared prefix under the preamble that the request's agent was recognised at (deeper
  shared prefixes that carry at least half of its traffic replace it: a new version of the anchor).

A request is labelled only once its agent's anchor is a shared prefix; until then `agent` is None.
Memory is bounded: at most `max_fingerprint_leaves` prompt tails are remembered (least recently seen
go first) and `max_agents` agents.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Final

from .config import PolicyConfig

_MASK64: Final = (1 << 64) - 1
_MAX_CANDIDATES: Final = 8    # sessions remembered for a prompt several sessions sent identically


class _Shared:
    """Owner of a prompt that several sessions sent identically: any of them may continue it."""

    __slots__ = ("members",)

    def __init__(self, members: tuple) -> None:
        self.members = members


_CROSSED = object()    # `via` value: the session went into two different children
_VIA_SESSIONS: Final = 64     # sessions remembered per shared prefix
_SESSIONS_PER_AGENT: Final = 3  # sessions per child above which children are agents, not task text
_MAX_CONCENTRATED: Final = 16  # without session evidence, a preamble's top children carry half its traffic
_SIGN64: Final = 1 << 63
# A prompt that leaves an earlier one at most this many blocks before its end continues it, when
# it shared at least _CONTINUE_SPAN times as many blocks past the anchor.
_CONTINUE_SLACK: Final = 3
_CONTINUE_SPAN: Final = 8
_OWNERS_SCAN: Final = 32   # nodes looked at below a shared prefix for the sessions that used it
_ANOTHER = object()        # `_one_session`: the request at hand, continuing no session
_UNSEEN = object()         # ... the request at hand not counted


def _one_session(p: _Node, lineage: dict, current: object = _UNSEEN) -> bool:
    """Whether every request known to have gone through `p` came from one conversation: the
    sessions that went through it later (`via`), and those whose prompts ended below it (a look at
    the first nodes under it), and the request at hand if given: `current` is the session it
    continues, None when it continues none (then it is another session). Sessions count as the
    conversation they resumed (`lineage`, see `set_owner`). False with no evidence at all."""
    seen: set = set(p.via) if p.via is not None else set()
    if current is _UNSEEN:
        pass
    elif current is None:
        seen.add(_ANOTHER)
    elif isinstance(current, _Shared):
        seen.update(lineage.get(m, m) for m in current.members)
    else:
        seen.add(lineage.get(current, current))
    if len(seen) >= 2:
        return False
    todo = [p]
    looked = 0
    while todo and looked < _OWNERS_SCAN:
        node = todo.pop()
        looked += 1
        owner = node.end_owner
        if isinstance(owner, _Shared):
            seen.update(lineage.get(m, m) for m in owner.members)
        elif owner is not None:
            seen.add(lineage.get(owner, owner))
        if len(seen) >= 2:
            return False
        if node.children:
            todo.extend(node.children.values())
    return len(seen) == 1 and _ANOTHER not in seen   # the request at hand alone is no evidence


def block_key(h: object) -> int:
    """A block hash (vLLM's `BlockHash` bytes, or any int) as the signed 64-bit int used here."""
    if isinstance(h, bytes):   # vLLM's case first: one C call
        return int.from_bytes(h[:8], "big", signed=True)
    if isinstance(h, int):
        v = h & _MASK64
    elif isinstance(h, (bytearray, memoryview)):
        v = int.from_bytes(bytes(h[:8]), "big")
    else:
        raise TypeError(f"block hash must be int or bytes, got {type(h).__name__}")
    return v - (1 << 64) if v & _SIGN64 else v


_leading_int64 = struct.Struct(">q").unpack_from   # the first 8 bytes of a buffer, signed big-endian


def block_keys(hashes: Sequence[Any]) -> list[int]:
    """`block_key` of each hash; vLLM's bytes (32 each) in one pass."""
    try:
        return [_leading_int64(h)[0] for h in hashes]
    except (TypeError, struct.error):   # ints, or buffers shorter than 8 bytes
        return [block_key(h) for h in hashes]


def _flag_kids(node: _Node) -> set[_Node]:
    """The shared prefixes nearest below a shared prefix (or the root): a set for every one."""
    kids = node.flag_kids
    assert kids is not None, "shared prefixes and the root keep their nearest shared prefixes"
    return kids


class _Node:
    __slots__ = ("nid", "parent", "start", "end", "seq", "children", "support", "last_seen",
                 "recent", "flagged", "flag_kids", "end_owner", "pre_at", "pre_val",
                 "via")

    def __init__(self, nid: int, parent: _Node | None, start: int, end: int, seq: array) -> None:
        self.nid = nid
        self.parent = parent
        self.start = start              # edge covers block positions [start, end)
        self.end = end                  # depth of the node, in blocks
        self.seq = seq                  # hashes of the edge: seq[i - start]
        self.children: dict[int, _Node] | None = None
        self.support = 0.0              # inflated: divide by the tree's weight for requests
        self.recent = 0.0               # the same with a short half-life, for structural choices
        self.last_seen = 0
        self.flagged = False            # is a shared prefix
        self.flag_kids: set[_Node] | None = None  # nearest shared prefixes below this one
        self.end_owner: object = None   # session (or _Shared sessions) whose prompt ended here
        self.pre_at = -1                # request number when `pre_val` was computed
        self.pre_val = False
        self.via: OrderedDict | None = None  # session -> child taken (first hash), or _CROSSED


@dataclasses.dataclass(slots=True)
class AgentRecord:
    agent_id: str
    key: int
    anchor_blocks: int       # learned anchor length (blocks)
    anchor_node: int         # id of the anchor's current version
    anchor_path: array       # block hashes of the current anchor (for version and branch checks)
    preamble_blocks: int     # leading blocks shared with other agents
    first_seen: int
    last_seen: int
    requests: int = 0
    keys: list[int] = dataclasses.field(default_factory=list)
    private_key: int = 0     # hash of its first block past the preamble, last time seen (its shared name)


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the fingerprinter recognised in one prompt."""

    agent: str | None            # None: no agent recognised (a new agent or a one-off prompt)
    anchor_blocks: int           # the agent's anchor, in blocks (0 when agent is None)
    anchor_node: int             # id of the anchor version (0 when agent is None)
    preamble_blocks: int         # leading blocks shared with other agents
    preamble_node: int           # id of that preamble (0: none)
    shared_blocks: int           # deepest prefix that is shared with other requests
    matched_blocks: int          # leading blocks identical to a prompt seen before
    continues: Hashable | None   # session whose earlier prompt this one continues, if any
    leaf: int                    # handle for `set_owner`
    candidates: tuple = ()       # sessions that sent the continued prompt identically (ambiguous)


class AgentFingerprinter:
    """Online agent recognition over chained block hashes."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        cfg = config or PolicyConfig()
        self.cfg = cfg
        self._growth = 2.0 ** (1.0 / cfg.fingerprint_half_life)
        self._weight = 1.0                 # inflation weight of the newest request
        self._rgrowth = 2.0 ** (8.0 / cfg.fingerprint_half_life)
        self._rweight = 1.0
        self._ids = itertools.count(1)
        self.root = _Node(0, None, 0, 0, array("q"))
        self.root.flagged = True           # sentinel: the preamble of agents that share nothing
        self.root.flag_kids = set()
        self._nodes: dict[int, _Node] = {}
        self._leaves: OrderedDict[int, _Node] = OrderedDict()  # least recently seen first
        self._flagged: set[_Node] = set()
        self._agents: OrderedDict[str, AgentRecord] = OrderedDict()
        self._by_key: dict[int, AgentRecord] = {}
        self.requests = 0
        self.retired: list[str] = []        # agents aged out since the caller last looked
        self.anchors_version = 0            # bumped when an agent's anchor or private key changes
        self._active_window = max(64, int(cfg.fingerprint_half_life // 4))
        self._pending: OrderedDict[int, list[tuple[_Node, int]]] = OrderedDict()  # leaf -> (prefix, child)
        self._repeats: OrderedDict[int, bool] = OrderedDict()  # handles of prompts seen before
        # A session whose first prompt continues another session's (a conversation that came back
        # after its session expired) -> the session that conversation began as. One conversation's
        # own branch points are its context, however many sessions it was split into.
        self._lineage: OrderedDict[Hashable, Hashable] = OrderedDict()
        self._max_lineage = cfg.max_fingerprint_leaves
        self._sweep_every = 256

    # -- public -------------------------------------------------------------------------------
    def observe(self, block_hashes: Sequence[int]) -> Fingerprint:
        """Walk one prompt (its full blocks' keys, see `block_key`) and recognise its agent."""
        cfg = self.cfg
        self.requests += 1
        t = self.requests
        self._weight *= self._growth
        self._rweight *= self._rgrowth
        if self._rweight > 1e100 or self._weight > 1e100:
            self._rescale()
        w = self._weight
        rw = self._rweight
        hashes = block_hashes if len(block_hashes) <= cfg.max_prompt_blocks else block_hashes[:cfg.max_prompt_blocks]
        n = len(hashes)

        root = self.root
        root.support += w
        root.recent += rw
        node = root
        d = 0
        path: list[_Node] = []
        ends_inside: _Node | None = None
        while d < n:
            kids = node.children
            ch = kids.get(hashes[d]) if kids else None
            if ch is None:
                break
            e = ch.end if ch.end <= n else n
            off = ch.start
            seq = ch.seq
            if hashes[e - 1] == seq[e - 1 - off]:
                j = e
            else:
                lo, hi = d + 1, e - 1   # hashes[d] matches: it is the child's key
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    if hashes[mid - 1] == seq[mid - 1 - off]:
                        lo = mid
                    else:
                        hi = mid - 1
                j = lo
            if j == ch.end:
                node = ch
                d = j
                path.append(ch)
                continue
            if j < n:               # diverges inside the edge: the split point is a branch
                node = self._split(ch, j)
                path.append(node)
            else:                   # ends inside the edge: a prefix of an earlier prompt
                ends_inside = ch
            d = j
            break
        matched = d

        # The deepest point where an earlier prompt ended and that this one goes past: this
        # prompt continues that one (a session's next call to the same agent).
        last_end = None
        for p in path:
            if p.end_owner is not None and p.end < n:
                last_end = p
        previous = last_end.end_owner if last_end is not None else None
        # An earlier prompt that this one follows up to a few blocks before its end (a session that
        # rewrote its last block: a moved cache marker, a replaced reminder): `_label` decides
        # whether that is close enough to be the same session.
        near: tuple[object, int] | None = None
        if d < n and node.children:
            for c in node.children.values():
                if c.children is None and c.end_owner is not None and c.end - d <= _CONTINUE_SLACK:
                    if near is None or c.end > near[1]:
                        near = (c.end_owner, c.end)
        leaf = node
        repeat = False
        if d < n:
            ended_shared = isinstance(node.end_owner, _Shared)
            if node.children is None and node is not root and not node.flagged and not ended_shared:
                # Grow the earlier prompt's tail in place. Its support restarts, so one session's
                # repeated calls never look like a prefix shared between requests. (A prompt that
                # several sessions sent keeps its end: each of them may continue it.)
                node.seq.extend(hashes[node.end:n])
                node.end = n
                node.end_owner = None
                node.support = 0.0
                node.recent = 0.0
            else:
                leaf = self._new_leaf(node, hashes, d, n)
                path.append(leaf)
        else:
            # The prompt ends where an earlier one passed: give its end a node of its own.
            if ends_inside is not None:
                leaf = self._split(ends_inside, n)
                path.append(leaf)
            repeat = leaf is not root
        if leaf is not root and leaf.children is None:
            self._leaves[leaf.nid] = leaf
            self._leaves.move_to_end(leaf.nid)

        for p in path:
            p.support += w
            p.recent += rw
            p.last_seen = t

        # Shared prefixes on the path (promote or demote as support changes).
        thr = max(cfg.fingerprint_min_support * w, cfg.fingerprint_min_share * root.support)
        shared: list[_Node] = []
        for p in path:
            if p.children is not None and len(p.children) >= 2 and p.support >= thr:
                if not p.flagged:
                    self._promote(p)
                shared.append(p)
            elif p.flagged:
                if p.support < 0.5 * thr:
                    self._demote(p)
                else:
                    shared.append(p)

        steps = [(p, hashes[p.end]) for p in (root, *shared) if p.end < n]
        self._pending[leaf.nid] = steps
        if len(self._pending) > 1024:
            self._pending.popitem(last=False)
        if repeat:
            self._repeats[leaf.nid] = True
            if len(self._repeats) > 1024:
                self._repeats.popitem(last=False)
        fp = self._label(hashes, n, shared, matched, previous, last_end, leaf, t, near)
        if t % self._sweep_every == 0:
            self._sweep(thr)
        self._age_out()
        return fp

    def set_owner(self, leaf: int, session: Hashable, continued: Hashable | None = None) -> None:
        """Record which session the prompt of `observe(...).leaf` belongs to; `continued`: the
        session whose prompt it continued (`Fingerprint.continues`), if another one (the
        conversation came back after that session expired: the same conversation).

        Also notes, at each shared prefix on its path, which shared prefix below it the session
        took: sessions that cross between the children of a prefix mark it as a preamble (agents
        under a framework header); sessions that always take the same child mark task text that
        several sessions repeat under one agent.
        """
        lineage = self._lineage
        if continued is not None and continued != session and session not in lineage:
            lineage[session] = lineage.get(continued, continued)
            if len(lineage) > self._max_lineage:
                lineage.popitem(last=False)
        node = self._nodes.get(leaf)
        repeat = self._repeats.pop(leaf, False)
        if node is not None:
            owner = node.end_owner
            if repeat and owner is not None and owner != session:
                # Several sessions sent this very prompt: remember them all (a few).
                members = owner.members if isinstance(owner, _Shared) else (owner,)
                if session not in members:
                    members = (members + (session,))[-_MAX_CANDIDATES:]
                node.end_owner = _Shared(members)
            else:
                node.end_owner = session
        conversation = lineage.get(session, session)
        for parent, child in self._pending.pop(leaf, ()):
            via = parent.via
            if via is None:
                via = parent.via = OrderedDict()
            seen = via.get(conversation)
            if seen is None:
                via[conversation] = child
                if len(via) > _VIA_SESSIONS:
                    via.popitem(last=False)
            elif seen != child and seen is not _CROSSED:
                via[conversation] = _CROSSED
                parent.pre_at = -1

    def agent(self, agent_id: str) -> AgentRecord | None:
        return self._agents.get(agent_id)

    def agents(self) -> list[AgentRecord]:
        return list(self._agents.values())

    def stats(self) -> dict[str, int]:
        return {"nodes": len(self._nodes), "leaves": len(self._leaves), "shared_prefixes": len(self._flagged),
                "agents": len(self._agents), "stored_hashes": sum(len(x.seq) for x in self._nodes.values())}

    # -- labelling ----------------------------------------------------------------------------
    def _label(self, hashes: Sequence[int], n: int, shared: list[_Node], matched: int, previous: object,
               last_end: _Node | None, leaf: _Node, t: int, near: tuple[object, int] | None = None) -> Fingerprint:
        pre = self.root
        pre_i = -1
        for i, p in enumerate(shared):
            if self._is_preamble(p, t):
                pre, pre_i = p, i
        # An anchor is text that several sessions start with: a branch point made by one session's
        # own calls (a conversation that rewrote its tail) is that session's context.
        current = previous if previous is not None else (near[0] if near is not None else None)
        lineage = self._lineage
        below = [p for p in shared[pre_i + 1:] if not _one_session(p, lineage, current)]
        shared_end = shared[-1].end if shared else 0
        anchor: _Node | None = None
        if below:
            anchor = below[0]
            for p in below[1:]:
                if p.recent >= 0.5 * anchor.recent:
                    anchor = p
                else:
                    break
        # A prompt that ended past the anchor (a session's context, not just the agent's text).
        continues = None
        candidates: tuple = ()
        past = anchor.end if anchor is not None else pre.end
        owner: object = None
        if last_end is not None and previous is not None and last_end.end > past:
            owner = previous
        elif near is not None and near[1] - matched <= min(_CONTINUE_SLACK, (matched - past) // _CONTINUE_SPAN):
            owner = near[0]   # followed an earlier prompt to within a few blocks of its end, far past the anchor
        if isinstance(owner, _Shared):
            candidates = owner.members
        elif owner is not None:
            continues = owner
        agent = None
        if pre.end < n:
            agent = self._agent_for(hashes, pre, shared[:pre_i + 1], anchor, t)
        if agent is None:
            return Fingerprint(None, 0, 0, pre.end, pre.nid, shared_end, matched, continues, leaf.nid,
                               candidates)
        anchor_blocks = agent.anchor_blocks
        if anchor is None and not (anchor_blocks <= n and hashes[anchor_blocks - 1] == agent.anchor_path[-1]):
            anchor_blocks = pre.end  # a version of the anchor not yet learned: only the preamble is sure
        return Fingerprint(agent.agent_id, anchor_blocks, agent.anchor_node, pre.end, pre.nid,
                           shared_end, matched, continues, leaf.nid, candidates)

    def _is_preamble(self, p: _Node, t: int) -> bool:
        if t - p.pre_at < 16:
            return p.pre_val
        kids = p.flag_kids
        val = False
        if kids and len(kids) >= 2:
            horizon = t - self._active_window
            active = 0
            carried = 0.0
            for k in kids:
                if k.last_seen >= horizon:
                    active += 1
                    carried += k.recent
            val = active >= 2 and carried >= 0.5 * p.recent
            if val:
                val = self._sessions_cross(p, kids)
        p.pre_at = t
        p.pre_val = val
        return val

    def _sessions_cross(self, p: _Node, kids: set[_Node]) -> bool:
        """Do sessions move between the shared prefixes below `p` (then it is a preamble)?"""
        via = p.via
        if _one_session(p, self._lineage):
            return False    # one session's own branches (its rewritten tails), not a header of agents
        if via:
            crossed = sum(1 for v in via.values() if v is _CROSSED)
            # Sessions moving between the children: agents under a shared header.
            if crossed >= 2:
                return True
            # Many sessions per child: agents (each used by many workflows). About one session
            # per child: task text (each workflow has its own, a few repeat it).
            if len(via) >= 16:
                children = {v for v in via.values() if v is not _CROSSED}
                return len(via) - crossed >= _SESSIONS_PER_AGENT * len(children)
        # Without session evidence: a preamble's traffic is concentrated on a few children.
        shares = sorted((k.recent for k in kids), reverse=True)
        half = 0.5 * sum(shares)
        acc = 0.0
        for i, x in enumerate(shares):
            acc += x
            if acc >= half:
                return i + 1 <= _MAX_CONCENTRATED
        return False

    def _agent_for(self, hashes: Sequence[int], pre: _Node, preambles: list[_Node], anchor: _Node | None,
                   t: int) -> AgentRecord | None:
        key = hashes[pre.end]
        rec = self._by_key.get(key)
        if rec is None:
            # The agent may be known under a shallower preamble (seen before this preamble was
            # recognised): accept it only if its anchor went through the same branch as this prompt.
            for p in reversed([self.root] + preambles[:-1]):
                cand = self._by_key.get(hashes[p.end])
                if cand is not None and pre.end < len(cand.anchor_path) and cand.anchor_path[pre.end] == key:
                    rec = cand
                    break
            if rec is None:
                if anchor is None:
                    return None
                rec = self._new_agent(key, t)
            rec.keys.append(key)
            self._by_key[key] = rec
        if anchor is not None and anchor.nid != rec.anchor_node:
            rec.anchor_node = anchor.nid
            rec.anchor_blocks = anchor.end
            self.anchors_version += 1
            rec.anchor_path = array("q", hashes[:anchor.end])
        rec.preamble_blocks = pre.end
        if rec.private_key != key:
            rec.private_key = key
            self.anchors_version += 1
        rec.last_seen = t
        rec.requests += 1
        self._agents.move_to_end(rec.agent_id)
        return rec

    def _new_agent(self, key: int, t: int) -> AgentRecord:
        agent_id = f"agent-{key & _MASK64:016x}"
        rec = AgentRecord(agent_id, key, 0, 0, array("q"), 0, t, t)
        self._agents[agent_id] = rec
        while len(self._agents) > self.cfg.max_agents:
            _, old = self._agents.popitem(last=False)
            for k in old.keys:
                if self._by_key.get(k) is old:
                    del self._by_key[k]
            self.retired.append(old.agent_id)
        return rec

    # -- tree maintenance ---------------------------------------------------------------------
    def _new_leaf(self, parent: _Node, hashes: Sequence[int], d: int, n: int) -> _Node:
        leaf = _Node(next(self._ids), parent, d, n, array("q", hashes[d:n]))
        if parent.children is None:
            parent.children = {}
            self._leaves.pop(parent.nid, None)
        parent.children[hashes[d]] = leaf
        self._nodes[leaf.nid] = leaf
        return leaf

    def _split(self, ch: _Node, j: int) -> _Node:
        """Cut edge `ch` at depth j: a new node takes the upper part, `ch` keeps the rest."""
        parent = ch.parent
        k = j - ch.start
        mid = _Node(next(self._ids), parent, ch.start, j, ch.seq[:k])
        mid.support = ch.support
        mid.recent = ch.recent
        mid.last_seen = ch.last_seen
        first = ch.seq[0]
        ch.seq = ch.seq[k:]
        ch.start = j
        ch.parent = mid
        mid.children = {ch.seq[0]: ch}
        assert parent is not None and parent.children is not None, "a split edge is below its parent"
        parent.children[first] = mid
        self._nodes[mid.nid] = mid
        return mid  # `mid` is not flagged, so every shared prefix keeps its nearest shared ancestor

    def _flag_parent(self, node: _Node) -> _Node:
        p = node.parent
        while p is not None and not p.flagged:
            p = p.parent
        return p or self.root

    def _promote(self, node: _Node) -> None:
        node.flagged = True
        node.flag_kids = kids = set()
        self._flagged.add(node)
        f = self._flag_parent(node)
        above = _flag_kids(f)
        moved = [k for k in above if self._is_below(k, node)]
        for k in moved:
            above.discard(k)
            kids.add(k)
        above.add(node)
        f.pre_at = -1
        node.pre_at = -1

    def _demote(self, node: _Node) -> None:
        f = self._flag_parent(node)
        above = _flag_kids(f)
        above.discard(node)
        above |= node.flag_kids or set()
        f.pre_at = -1
        node.flagged = False
        node.flag_kids = None
        self._flagged.discard(node)
        self._tidy(node)

    @staticmethod
    def _is_below(k: _Node, node: _Node) -> bool:
        p = k.parent
        while p is not None and p.end >= node.end:
            if p is node:
                return True
            p = p.parent
        return False

    def _tidy(self, node: _Node) -> None:
        """Restore the radix invariant at an unflagged node that lost children."""
        if node is self.root or node.flagged:
            return
        kids = node.children
        if not kids:
            node.children = None
            self._leaves[node.nid] = node
            self._leaves.move_to_end(node.nid, last=False)
        elif len(kids) == 1:
            (child,) = kids.values()
            parent = node.parent
            child.seq = node.seq + child.seq
            child.start = node.start
            child.parent = parent
            assert parent is not None and parent.children is not None, "only the root has no parent"
            parent.children[node.seq[0]] = child
            del self._nodes[node.nid]

    def _age_out(self) -> None:
        cap = self.cfg.max_fingerprint_leaves
        while len(self._leaves) > cap:
            _, leaf = self._leaves.popitem(last=False)
            parent = leaf.parent
            assert parent is not None and parent.children is not None, "the root is never a leaf here"
            del parent.children[leaf.seq[0]]
            del self._nodes[leaf.nid]
            if not parent.children:
                parent.children = None
            self._tidy(parent)

    def _sweep(self, thr: float) -> None:
        for node in list(self._flagged):
            if node.support < 0.5 * thr:
                self._demote(node)

    def _rescale(self) -> None:
        k = 1.0 / self._weight
        rk = 1.0 / self._rweight
        self.root.support *= k
        self.root.recent *= rk
        for node in self._nodes.values():
            node.support *= k
            node.recent *= rk
        self._weight = 1.0
        self._rweight = 1.0
