"""Multi-agent workloads built from real agent anchors and real task text (see data/PROVENANCE.md).

The framework is a supervisor with five specialists. Every call's prompt is
    shared framework preamble + the agent's anchor + the user's task + that agent's context,
where the supervisor's context is every specialist's answer so far and a specialist's context is
the supervisor's instructions to it and its own earlier work (outputs, tool observations). Contexts
are append-only, so a session's next call to the same agent extends its previous prompt. The
supervisor decides at run time which specialist runs next, from a stochastic policy that depends on
the task family and on the last specialist; every specialist hands back to the supervisor; the
summarizer ends the session. Sessions arrive as a
Poisson process (or in bursts); inside a session, each call is issued a tool/think latency after the
previous one finished (closed loop).

Task text is real where it exists offline (GSM8K questions, MT-Bench questions with their second
turn, SWE-bench Verified issue titles). GAIA questions and SWE-bench issue bodies are not available,
so their tokens are generated with the published length statistics; generated tokens are random
vocabulary ids, which is all a KV cache can see of them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Generic, TypeVar

from cachescout.policy import ExternalError, InputError

FAMILIES = ("gsm8k", "mtbench", "gaia", "swebench")
ROUTINGS = ("learned", "uniform", "random")
ARRIVALS = ("poisson", "bursty")
VOCAB = 128_000  # Llama-3 vocabulary size (generated tokens are drawn from it)

# Which real anchor plays which role (keys of data/anchors/manifest.json).
AGENT_ANCHORS = {
    "supervisor": "magentic_one_orchestrator",
    "coder": "smolagents_code_agent",
    "searcher": "smolagents_toolcalling_searcher",
    "math": "lm_eval_gsm8k_cot_8shot",
    "critic": "metagpt_code_review",
    "summarizer": "openhands_condenser_summarizer",
}
PREAMBLE_ANCHOR = "openai_agents_handoff_prefix"  # the SDK recommends it in front of every agent
SPECIALISTS = ("coder", "searcher", "math", "critic", "summarizer")

# Supervisor's routing: P(next specialist | task family), before the per-step adjustments below.
ROUTING = {
    "gsm8k": {"math": 0.50, "coder": 0.15, "critic": 0.20, "searcher": 0.05, "summarizer": 0.10},
    "mtbench": {"searcher": 0.15, "critic": 0.35, "summarizer": 0.20, "coder": 0.10, "math": 0.20},
    "gaia": {"searcher": 0.50, "coder": 0.15, "math": 0.10, "critic": 0.15, "summarizer": 0.10},
    "swebench": {"coder": 0.50, "searcher": 0.25, "critic": 0.17, "math": 0.03, "summarizer": 0.05},
}
# Output tokens per call (lognormal: median, sigma) and tool observation tokens added to the transcript.
OUTPUT = {"supervisor": (60, 0.4), "coder": (320, 0.5), "searcher": (180, 0.5), "math": (220, 0.4),
          "critic": (150, 0.5), "summarizer": (200, 0.4)}
OBSERVATION = {"coder": (250, 0.8), "searcher": (450, 0.7)}
# Latency between a call's end and the session's next call (lognormal: median seconds, sigma):
# tool execution after coder/searcher, framework overhead otherwise.
THINK = {"coder": (1.5, 0.8), "searcher": (2.5, 0.7), "supervisor": (0.05, 0.3)}
THINK_DEFAULT = (0.15, 0.5)


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One LLM call: its prompt as segments (shared tuples, concatenated when issued)."""

    agent: str
    segments: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]
    think_s: float  # issue the session's next call this long after this one finishes

    def prompt(self) -> list[int]:
        out: list[int] = []
        for seg in self.segments:
            out.extend(seg)
        return out

    # What the replay engine asks of a call (trace records answer the same, without tokens).
    def prompt_tokens(self) -> list[int]:
        return self.prompt()

    @property
    def prompt_len(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def output_len(self) -> int:
        return len(self.output)


CallT = TypeVar("CallT")   # a workload's `Call`, or a trace's `TraceCall`


@dataclasses.dataclass(frozen=True, slots=True)
class Session(Generic[CallT]):
    """One workflow instance: calls issued in order, closed-loop by default (each call its
    predecessor's `think_s` after that one finished).

    - `offsets_s`: open loop instead: call k is issued at `arrival_s + offsets_s[k]`, whenever the
      calls before it finish (a trace replayed at its recorded times).
    - `parent`, `after_call`: a sub-session (a sub-agent): it starts `arrival_s` seconds after call
      `after_call` of session `parent` finished, and that session's next call waits until every
      sub-session it started has finished (then its own think time). The engines resolve this
      with `replay.SessionFlow`."""

    session_id: str
    family: str
    arrival_s: float
    calls: tuple[CallT, ...]
    offsets_s: tuple[float, ...] = ()
    parent: str | None = None
    after_call: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    family: str = "mixed"           # one of FAMILIES, or "mixed"
    sessions: int = 400
    rate: float = 2.0               # sessions per second (mean)
    arrivals: str = "poisson"       # "poisson" or "bursty"
    routing: str = "learned"        # "learned" (task-dependent), "uniform" (supervisor picks
                                    # uniformly) or "random" (any agent after any, random end)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES + ("mixed",):
            raise InputError(f"family must be one of {', '.join(FAMILIES + ('mixed',))}, got {self.family!r}")
        if self.arrivals not in ARRIVALS:
            raise InputError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if self.routing not in ROUTINGS:
            raise InputError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not (self.sessions > 0 and self.rate > 0 and math.isfinite(self.rate)):
            raise InputError("sessions and rate must be positive")


# -- material ---------------------------------------------------------------------------------
def _data(name: str) -> str:
    return resources.files("cachescout.bench").joinpath("data", name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def tokenizer():
    try:
        import quicktok
    except ImportError as exc:  # pragma: no cover - the bench extra pins it
        raise ExternalError("the benchmark needs the 'quicktok-v1' package (pip install 'cachescout[bench]')") from exc
    return quicktok.get_encoding("llama3")


@functools.lru_cache(maxsize=None)
def encode(text: str) -> tuple[int, ...]:
    return tuple(tokenizer().encode(text))


@functools.lru_cache(maxsize=1)
def anchors() -> dict[str, tuple[int, ...]]:
    """Token ids of each agent's anchor (preamble included), Llama-3 tokenizer."""
    pre = _data(f"anchors/{PREAMBLE_ANCHOR}.txt")
    return {agent: encode(pre + "\n\n" + _data(f"anchors/{key}.txt")) for agent, key in AGENT_ANCHORS.items()}


@functools.lru_cache(maxsize=1)
def _tasks() -> dict[str, list]:
    gsm = [json.loads(x)["question"] for x in _data("tasks/gsm8k_test_100.jsonl").splitlines() if x.strip()]
    mt = [json.loads(x)["turns"] for x in _data("tasks/mt_bench_questions.jsonl").splitlines() if x.strip()]
    swe = [x["abstract_description"] for x in json.loads(_data("tasks/swebench_verified_titles.json"))]
    gaia = json.loads(_data("tasks/gaia_length_stats.json"))["subset_stats"]
    return {"gsm8k": gsm, "mtbench": mt, "swebench": swe, "gaia": gaia}


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1000, VOCAB) for _ in range(max(1, n)))


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


# -- sessions ---------------------------------------------------------------------------------
def _task(rng: random.Random, family: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(first user turn, optional second user turn) as tokens."""
    tasks = _tasks()
    if family == "gsm8k":
        return encode("Task: " + rng.choice(tasks["gsm8k"])), None
    if family == "mtbench":
        turns = rng.choice(tasks["mtbench"])
        second = encode("Follow-up from the user: " + turns[1]) if len(turns) > 1 else None
        return encode("Task: " + turns[0]), second
    if family == "swebench":
        title = rng.choice(tasks["swebench"])
        # Issue bodies are not available offline: ~1,700 characters on average (about 4 per token).
        body = _random_tokens(rng, int(_lognormal(rng, 1300, 0.7) / 4))
        return encode("Task: resolve this GitHub issue.\nTitle: " + title + "\nBody:\n") + body, None
    subsets = tasks["gaia"]
    sub = rng.choices(subsets, weights=[s["sample_count"] for s in subsets])[0]
    chars = min(max(rng.gauss(sub["prompt_length_mean"], sub["prompt_length_std"]), sub["prompt_length_min"]),
                sub["prompt_length_max"])
    return encode("Task: ") + _random_tokens(rng, int(chars / 4)), None


def _route(rng: random.Random, family: str, last: str | None, visits: dict, uniform: bool) -> str:
    if uniform:
        return rng.choice(SPECIALISTS)
    weights = dict(ROUTING[family])
    if last is not None and last != "critic":
        weights["critic"] = weights.get("critic", 0.0) + 0.25      # review what was just produced
    if last == "critic":
        weights["summarizer"] += 0.2
    rounds = sum(visits.values())
    weights["summarizer"] += 0.06 * rounds                          # wrap up as the work accumulates
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def _session(rng: random.Random, sid: str, family: str, arrival: float, routing: str) -> Session:
    """One workflow. The supervisor sees the task and every specialist's answer; a specialist sees
    the task, the supervisor's instruction and its own earlier work in this session (its memory),
    as with smolagents' managed agents or agents-as-tools. Every context is append-only, so an
    agent's next call extends its previous prompt."""
    anchor = anchors()
    task, second_turn = _task(rng, family)
    board: list[tuple[int, ...]] = []                 # what the supervisor sees
    memory: dict[str, list[tuple[int, ...]]] = {}     # what each specialist saw and did
    calls: list[Call] = []
    visits: dict[str, int] = {}
    last: str | None = None
    agent = "supervisor"
    instruction: tuple[int, ...] = ()
    while True:
        uniform = routing != "learned"
        out = _random_tokens(rng, int(_lognormal(rng, *OUTPUT[agent])))
        if uniform and agent != "supervisor":
            think = _lognormal(rng, *THINK_DEFAULT)
        else:
            think = _lognormal(rng, *THINK.get(agent, THINK_DEFAULT))
        # A prompt ends with the agent's turn header, as chat templates end with the assistant
        # header, so the prompt followed by the output is a prefix of what comes next.
        header = encode(f"\n[{agent}]: ")
        if agent == "supervisor":
            calls.append(Call(agent, (anchor[agent], task, *board, header), out, think))
            instruction = header + out
            board.append(instruction)
        else:
            own = memory.setdefault(agent, [])
            own.append(instruction)
            calls.append(Call(agent, (anchor[agent], task, *own, header), out, think))
            own.append(header + out)
            board.append(header + out)
            if agent in OBSERVATION:
                own.append(encode("\n[observation]: ") + _random_tokens(rng, int(_lognormal(rng, *OBSERVATION[agent]))))
        if routing == "random":
            # No pattern at all: any agent after any, and the session may end after any call.
            if rng.random() < 1 / 8 or len(calls) >= 25:
                break
            agent = rng.choice(tuple(AGENT_ANCHORS))
            instruction = ()
            continue
        if agent == "summarizer" or len(calls) >= 25:
            if second_turn is not None:        # MT-Bench: the user asks the follow-up question
                board.append(second_turn)
                second_turn = None
                visits.clear()
                agent, last = "supervisor", None
                continue
            break
        if agent == "supervisor":
            last = agent = _route(rng, family, last, visits, routing == "uniform")
            visits[agent] = visits.get(agent, 0) + 1
        else:
            agent = "supervisor"
    return Session(sid, family, arrival, tuple(calls))


def generate(spec: WorkloadSpec) -> list[Session]:
    """Sessions of a workload, deterministic from `spec.seed`."""
    rng = random.Random(f"cachescout:{spec.seed}:{spec.family}:{spec.routing}")
    sessions = []
    t = 0.0
    burst_left = 0
    for i in range(spec.sessions):
        if spec.arrivals == "poisson":
            t += rng.expovariate(spec.rate)
        else:  # bursts of ~8 sessions arriving together, same mean rate
            if burst_left == 0:
                burst_left = max(1, int(rng.expovariate(1 / 8)))
                t += rng.expovariate(spec.rate / 8)
            else:
                t += rng.expovariate(spec.rate * 20)
            burst_left -= 1
        family = rng.choice(FAMILIES) if spec.family == "mixed" else spec.family
        sessions.append(_session(rng, f"s{i}", family, t, spec.routing))
    return sessions


def anchor_share(sessions: Sequence[Session]) -> float:
    """Share of all prompt tokens that are the calling agent's anchor."""
    a = anchors()
    anchor_tokens = total = 0
    for s in sessions:
        for c in s.calls:
            anchor_tokens += len(a[c.agent])
            total += c.prompt_len
    return anchor_tokens / total if total else 0.0


def waits_varied(sessions: Sequence[Session], j: int, spread: float) -> list[Session]:
    """The `j`th variation of some traffic (0: as given): every wait, each call's think time, each
    gap between open-loop calls and each sub-session's delay after its parent's call, scaled by its
    own factor drawn in [1 - spread, 1 + spread] (seeded by `j`, so every policy replays the same
    variation). Conversations keep their starts, calls and lengths. A closed loop is chaotic: which
    context is evicted just before its conversation returns turns on seconds, so one replay of a
    mix is one draw of outcomes that differ by several points of TTFT; replays of a few
    variations, every policy on each, sample them."""
    if j == 0 or spread == 0.0:
        return list(sessions)
    rng = random.Random(j)
    out = []
    for s in sessions:
        calls = tuple(dataclasses.replace(c, think_s=c.think_s * (1.0 + rng.uniform(-spread, spread)))
                      for c in s.calls)
        offsets = s.offsets_s
        if offsets:
            at = [offsets[0]]
            for a, b in itertools.pairwise(offsets):
                at.append(at[-1] + (b - a) * (1.0 + rng.uniform(-spread, spread)))
            offsets = tuple(at)
        arrival = s.arrival_s * (1.0 + rng.uniform(-spread, spread)) if s.parent is not None else s.arrival_s
        out.append(dataclasses.replace(s, arrival_s=arrival, calls=calls, offsets_s=offsets))
    return out


def iter_calls(sessions: Sequence[Session]) -> Iterator[tuple[Session, int, Call]]:
    for s in sessions:
        for i, c in enumerate(s.calls):
            yield s, i, c
