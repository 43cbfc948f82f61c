"""Spent blocks: the blocks of a context's call that the context's next call left out (an edited,
compacted or rewound conversation; an output that came back re-rendered) leave before blocks still
in use, as far as such blocks were seen not to be used again."""

import pytest
from helpers import anchor, chain

from cachescout.policy import CacheScoutPolicy, Hints, PolicyConfig


class _Server:
    """Calls through the policy as a block pool would: hits are the cached prefix; every call's
    blocks are freed when it ends (deepest first); `evict` drops blocks from the cache."""

    def __init__(self, policy: CacheScoutPolicy) -> None:
        self.policy = policy
        self.cached: set = set()
        self.now = 0.0
        self.n = 0

    def call(self, session: str, blocks: list, output: list | None = None) -> list:
        p, self.n, self.now = self.policy, self.n + 1, self.now + 1.0
        keys = chain(blocks)
        p.observe(self.n, keys, hints=Hints(agent="X", session=session), now=self.now)
        hit = next((i for i, k in enumerate(keys) if k not in self.cached), len(keys))
        p.blocks_reused(keys[:hit])
        p.admit_blocks(self.n, keys, hit)
        held = list(keys)
        if output:
            out = chain(blocks + output)[len(blocks):]
            p.extend_blocks(self.n, out)
            held += out
        self.cached.update(held)
        p.finish(self.n, now=self.now + 0.5)
        p.blocks_freed(list(reversed(held)), now=self.now + 0.5)
        return held

    def evict(self, n: int) -> list:
        out = self.policy.evict(n, now=self.now + 1.0)
        self.cached.difference_update(out)
        return out


def _edited_conversations(server: _Server, count: int) -> list:
    """`count` conversations of two calls, the second editing the first's last four blocks away;
    returns the blocks left out, in the order they were left."""
    left = []
    for c in range(count):
        x = anchor("X", 4) + [("task", c)]
        first = server.call(f"e{c}", x + [("draft", c, i) for i in range(4)])
        server.call(f"e{c}", x + [("edit", c, 0)])
        left += first[len(x):]
    return left


@pytest.mark.parametrize("trust_nothing", [False, True])
def test_blocks_a_later_call_left_out_go_first_once_seen_unused(trust_nothing):
    """An idle conversation's context stays; what edited conversations left behind goes first,
    though LRU would evict the idle conversation (the oldest) first. An operator who trusts
    nothing (`min_confidence` 1) gets LRU's order."""
    server = _Server(CacheScoutPolicy(PolicyConfig(min_confidence=1.0 if trust_nothing else 0.05)))
    idle = server.call("idle", anchor("X", 4) + [("idle", i) for i in range(4)])
    left = _edited_conversations(server, 40)
    share, conf = server.policy.inspect().traffic.spent_reuse()
    assert share < 0.01 and conf > 0.7          # 160 left out, none used again
    index = server.policy.inspect().index
    assert all(index.block(k).spent for k in left)
    # Set apart once 64 were counted (and seen unused): those of the conversations after that.
    apart = [k for k in left if index.block(k).group.kind == "spent"]
    assert 64 <= len(left) - len(apart) <= 72     # (counted with a slow decay)
    victims = server.policy.victims(len(apart), now=server.now + 1.0)
    if trust_nothing:
        assert victims[:4] == list(reversed(idle[4:]))    # LRU: the idle conversation's tail first
    else:
        assert set(victims) == set(apart)
        assert not set(idle) & set(victims)


@pytest.mark.parametrize("evicted", [False, True])
def test_spent_blocks_used_again_are_counted_and_then_stay_with_their_context(evicted):
    """A conversation that keeps returning to a branch it left (drafts compared, a rewind) uses
    its spent blocks again: counted whether they were still cached (a hit) or had been evicted
    and are computed again (a miss). Where most come back, spent blocks are not set apart: they
    stay in their context's group, scored with it."""
    server = _Server(CacheScoutPolicy(PolicyConfig()))
    index = server.policy.inspect().index
    for c in range(30):
        x = anchor("X", 4) + [("task", c)]
        branches = [x + [("a", c, i) for i in range(3)], x + [("b", c, i) for i in range(3)]]
        for turn in range(4):
            server.call(f"r{c}", branches[turn % 2])
            if evicted:   # the cache drops the branch just left: it comes back as a miss
                left = [k for k in chain(branches[(turn + 1) % 2])[len(x):] if k in index]
                server.policy.blocks_evicted(left)
                server.cached.difference_update(left)
    share, conf = server.policy.inspect().traffic.spent_reuse()
    assert conf > 0.5
    assert share > 0.6        # each branch was left 1-2 times and used again 1 time in each conversation
    last = chain(branches[0])[len(x):]
    assert all(index.block(k).spent and index.block(k).group.kind == "context" for k in last if k in index)
    assert any(k in index for k in last) != evicted


@pytest.mark.parametrize("carried", [True, False])
def test_outputs_a_context_does_not_carry_are_spent_as_soon_as_they_are_made(carried):
    """Where a context's next call carries its previous output as generated, the output's blocks
    stay with the context; where it comes back otherwise (re-rendered: they never hit), the
    policy learns that and files later outputs as spent at once, before the next call."""
    server = _Server(CacheScoutPolicy(PolicyConfig()))
    for c in range(20):
        x = anchor("X", 4) + [("task", c)]
        answer = [("answer", c, i) for i in range(2)]
        server.call(f"o{c}", x, output=answer)
        server.call(f"o{c}", x + (answer if carried else [("rendered", c, i) for i in range(2)]) + [("next", c)])
    assert server.policy.inspect().traffic.outputs_carried() is carried
    held = server.call("new", anchor("X", 4) + [("task", "new")], output=[("answer", "new", 0)])
    kinds = {server.policy.inspect().index.block(k).group.kind for k in held[-1:]}
    assert kinds == ({"context"} if carried else {"spent"})


def test_a_call_that_shares_no_more_than_the_anchor_spends_nothing():
    """A call taken for the session that shares no more than the agent's anchor with the
    session's previous call (another conversation matched to it, or one started afresh) tells
    nothing of what that call left: its context stays where it was."""
    server = _Server(CacheScoutPolicy(PolicyConfig()))
    _edited_conversations(server, 20)      # the anchor is known, and spent blocks are set apart
    first = server.call("m", anchor("X", 4) + [("task", "m")] + [("draft", "m", i) for i in range(4)])
    second = server.call("m", anchor("X", 4) + [("task", "other")] + [("draft", "other", i) for i in range(4)])
    index = server.policy.inspect().index
    assert {index.block(k).group.kind for k in first[4:]} == {"context"}
    server.call("m", anchor("X", 4) + [("task", "other"), ("edit", "other")])   # goes on with `second`
    assert {index.block(k).group.kind for k in second[5:]} == {"spent"}
    assert {index.block(k).group.kind for k in first[4:]} == {"context"}
