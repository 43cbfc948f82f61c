import random
from collections import Counter, defaultdict

import pytest
from helpers import anchor, chain, task

from cachescout.policy import AgentFingerprinter, PolicyConfig, block_key, block_keys


def run(anchors: dict, calls: int, seed: int = 0, sessions: int = 20, shared_tasks: int = 0, cfg=None,
        change_at=None, changed=None):
    """Interleaved sessions calling random agents; prompt = anchor + task + history."""
    rng = random.Random(seed)
    fp = AgentFingerprinter(cfg or PolicyConfig())
    history: dict[int, list] = {}
    sid: dict[int, tuple] = {}
    labels = []
    for i in range(calls):
        if change_at is not None and i == change_at:
            anchors = dict(anchors, **changed)
        s = rng.randrange(sessions)
        if s not in history or rng.random() < 0.1:
            body = task(rng.randrange(shared_tasks)) if shared_tasks else task(1000 + i)
            history[s] = list(body)
            sid[s] = (s, i)  # a new task is a new session
        agent = rng.choice(sorted(anchors))
        blocks = anchors[agent] + history[s]
        f = fp.observe(chain(blocks))
        fp.set_owner(f.leaf, sid[s])
        labels.append((i, agent, f))
        history[s].append(("out", i))
    return fp, labels


def majority(labels, since=0):
    by_agent = defaultdict(Counter)
    for i, agent, f in labels:
        if i >= since:
            by_agent[agent][f.agent] += 1
    return {a: c.most_common(1)[0] for a, c in by_agent.items()}, by_agent


def test_agents_without_a_common_prefix_are_told_apart():
    anchors = {n: anchor(n, 10 + 5 * k) for k, n in enumerate("ABCDE")}
    fp, labels = run(anchors, 600)
    top, by_agent = majority(labels, since=100)
    ids = [lab for lab, _ in top.values()]
    assert None not in ids and len(set(ids)) == 5
    for a, (_, n) in top.items():
        assert n / sum(by_agent[a].values()) > 0.99
    last = {a: f for _, a, f in labels}
    for a, f in last.items():
        assert f.anchor_blocks == len(anchors[a]) and f.preamble_blocks == 0


def test_shared_preamble_does_not_merge_agents():
    anchors = {n: anchor(n, 8, header=30) for n in "ABCDEF"}   # header longer than any private part
    fp, labels = run(anchors, 900)
    top, by_agent = majority(labels, since=150)
    assert len({lab for lab, _ in top.values()}) == 6 and None not in {lab for lab, _ in top.values()}
    for a, (_, n) in top.items():
        assert n / sum(by_agent[a].values()) > 0.98
    f = labels[-1][2]
    assert f.preamble_blocks == 30 and f.anchor_blocks == 38


def test_anchor_version_change_keeps_the_agent():
    anchors = {n: anchor(n, 20, header=5) for n in "ABCD"}
    new_c = anchors["C"] + [("C", "new-tool", i) for i in range(3)]
    fp, labels = run(anchors, 2400, change_at=1200, changed={"C": new_c})
    before, _ = majority([x for x in labels if x[0] < 1200], since=200)
    after, by_agent = majority([x for x in labels if x[0] >= 1600])
    assert after["C"][0] == before["C"][0]
    assert after["C"][1] / sum(by_agent["C"].values()) > 0.95
    tail = [f for i, a, f in labels if a == "C" and i >= 2000]
    assert all(f.anchor_blocks == len(new_c) for f in tail)


def test_task_text_repeated_by_sessions_does_not_split_an_agent():
    anchors = {n: anchor(n, 12) for n in "AB"}
    fp, labels = run(anchors, 3000, shared_tasks=80)  # a pool of 80 task texts, as MT-Bench has
    top, by_agent = majority(labels, since=200)
    for a, (_, n) in top.items():
        assert n / sum(by_agent[a].values()) > 0.97
    assert len({lab for lab, _ in top.values()}) == 2


def test_first_call_of_a_new_agent_is_unknown_not_misfiled():
    fp = AgentFingerprinter(PolicyConfig())
    first = fp.observe(chain(anchor("A", 10) + task(1)))
    assert first.agent is None and first.anchor_blocks == 0


def test_memory_is_bounded_under_thousands_of_distinct_prompts():
    cfg = PolicyConfig(max_fingerprint_leaves=256)
    fp = AgentFingerprinter(cfg)
    rng = random.Random(3)
    for i in range(5000):
        fp.observe(chain([("uniq", i, k) for k in range(rng.randint(1, 40))]))
    st = fp.stats()
    assert st["leaves"] <= 256
    assert st["nodes"] <= 2 * 256
    assert st["stored_hashes"] <= 256 * 40
    assert st["agents"] == 0


def test_agents_age_out_beyond_the_cap():
    cfg = PolicyConfig(max_agents=3, max_fingerprint_leaves=4096)
    fp = AgentFingerprinter(cfg)
    for k in range(8):
        for s in range(6):
            fp.observe(chain(anchor(f"agent{k}", 6) + task(k * 100 + s)))
    assert len(fp.agents()) <= 3
    assert len(fp.retired) >= 4


def test_continuation_names_the_session_of_the_extended_prompt():
    fp = AgentFingerprinter(PolicyConfig())
    a = anchor("A", 6)
    for s in range(4):  # make A's anchor a known shared prefix
        fp.set_owner(fp.observe(chain(a + task(s))).leaf, f"s{s}")
    f = fp.observe(chain(a + task(2) + [("out", 1)]))
    assert f.continues == "s2"
    other = fp.observe(chain(a + task(99)))
    assert other.continues is None


def test_block_key_accepts_vllm_bytes_and_ints():
    assert block_key(5) == 5
    assert block_key(-1) == -1
    assert block_key(2**64 + 7) == 7
    assert block_key(b"\x00" * 7 + b"\x09" + b"rest") == 9
    with pytest.raises(TypeError):
        block_key("abc")


def test_block_keys_equal_block_key_of_each():
    rng = random.Random(3)
    vllm_hashes = [rng.randbytes(32) for _ in range(50)]
    mixed = [5, b"\xff" * 8, bytearray(b"\x00" * 7 + b"\x02"), b"\x01\x02", -3, 2**70]
    for hashes in (vllm_hashes, mixed, [b"short"], []):
        assert block_keys(hashes) == [block_key(h) for h in hashes]
    with pytest.raises(TypeError):
        block_keys([b"\x00" * 32, "abc"])


def test_many_agents_under_one_header_are_told_apart():
    names = [f"agent{k:02d}" for k in range(40)]
    anchors = {n: anchor(n, 6, header=12) for n in names}
    fp, labels = run(anchors, 8000, sessions=60, seed=5)
    top, by_agent = majority(labels, since=4000)
    assert len({lab for lab, _ in top.values()}) == 40 and None not in {lab for lab, _ in top.values()}
    accuracy = sum(n for _, n in top.values()) / sum(sum(c.values()) for c in by_agent.values())
    assert accuracy > 0.98


def test_one_conversation_split_into_sessions_never_becomes_an_agent():
    # A long conversation whose session expires between bursts of calls comes back as new
    # sessions, each prompt extending the last and rewriting its final block (a reminder that the
    # next call drops). Its own branch points are its context, not an agent's anchor shared by
    # several sessions: were they, the whole conversation would be scored as an anchor.
    fp = AgentFingerprinter(PolicyConfig())
    history = [("conv", i) for i in range(40)]
    session = "c0"
    agents = []
    for call in range(60):
        if call % 6 == 0 and call:
            session = f"c{call}"   # the tracker expired the last session: a new one
        f = fp.observe(chain(history + [("reminder", call)]))
        if call:
            assert f.continues is not None   # it does continue the previous prompt
        fp.set_owner(f.leaf, session, f.continues)
        agents.append((f.agent, f.anchor_blocks))
        history += [("turn", call, i) for i in range(3)]
    assert all(a is None for a, _ in agents), agents
