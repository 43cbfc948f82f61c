"""Accuracy of what CacheScout inferred, against the workload's ground truth."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence


def inference_accuracy(observations: Sequence[tuple], warmup: int = 0) -> dict:
    """Agent recognition, session continuity and next-agent prediction for one run.

    - agent_accuracy: share of calls labelled with their agent's most frequent label (after
      `warmup` calls), counted only when no two agents share a most frequent label;
      agent_recognised: share labelled at all.
    - session_continuity: share of calls (not first in their session) put in the same inferred
      session as their session's previous call: what counting a transition needs.
    - session_new_precision: share of sessions' first calls that opened a new inferred session.
    - prediction_accuracy: share of calls whose agent was the chain's top guess from the session's
      previous agent (in the policy's own labels), over the calls it could guess.
    """
    by_agent: dict[str, Counter] = defaultdict(Counter)
    recognised = total = 0
    prev_session: dict[str, object] = {}
    cont = cont_ok = first = first_new = 0
    guessed = guessed_ok = 0
    for i, (req, obs) in enumerate(observations):
        true_session = req.session.session_id
        if i >= warmup:
            total += 1
            recognised += obs.agent is not None
            by_agent[req.agent][obs.agent] += 1
            if req.index == 0:
                first += 1
                first_new += obs.new_session
            else:
                cont += 1
                cont_ok += prev_session.get(true_session) == obs.session
            if obs.predicted_agent is not None and obs.agent is not None:
                guessed += 1
                guessed_ok += obs.predicted_agent == obs.agent
        prev_session[true_session] = obs.session
    majority = {a: c.most_common(1)[0] for a, c in by_agent.items()}
    labels = [lab for lab, _ in majority.values()]
    distinct = None not in labels and len(set(labels)) == len(labels)
    correct = sum(n for lab, n in majority.values() if lab is not None) if distinct else 0
    return {
        "agent_accuracy": correct / total if total else 0.0,
        "agent_recognised": recognised / total if total else 0.0,
        "agents_distinct": distinct,
        "session_continuity": cont_ok / cont if cont else 0.0,
        "session_new_precision": first_new / first if first else 0.0,
        "prediction_accuracy": guessed_ok / guessed if guessed else 0.0,
        "predictions": guessed,
    }
