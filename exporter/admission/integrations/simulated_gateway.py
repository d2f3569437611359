"""A gateway in simulated time: the `agents-join` workload sent to simulated vLLM servers, with or
without admission, so the effect of admission is a test and a benchmark rather than a claim.

Everything runs on one simulated clock: the simulator's engines (`exporter.simulator.Simulator`,
its own step physics), the daemon's real poll pipeline (`Poller` -> engine adapter -> window ->
Reading) reading the simulators' /metrics pages every poll interval, and the admission book fed by
those readings. The gateway here replays the scenario's users itself (the simulator would submit
them straight to its one engine): chat users in a closed loop, agent sessions at their scripted
time, each request asking the book before it is sent.

  * `shared`: no admission, one server takes everything (what happens today);
  * `pools`: admission with pools `chat` (short) and `agents` (long, slower target); each request
    asks with `pool: auto`; a refused one waits at the gateway and asks again as budget frees;
  * `one-pool`: admission on the chat server alone: what does not fit waits at the gateway.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from exporter.admission.book import AdmissionBook, AdmissionRequest
from exporter.admission.wiring import book_from_config, sync_at_every_poll
from exporter.serve.config import Config, Tls, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.poller import Poller
from exporter.simulator import AGENTS_JOIN_SECONDS, ServerSpec, SimRequest, Simulator
from exporter.simulator.scenarios import (
    ClosedLoopGroup,
    Scenario,
    ScriptedGroup,
    load_scenario,
)

CHAT_TARGET, AGENTS_TARGET = "chat-0:8000", "agents-0:8000"
SPLIT_TOKENS = 32_000
CHAT_TARGET_TOKENS_PER_SECOND = 50.0
# The long-context pool promises slower streams: its budget is set for this speed.
AGENTS_TARGET_TOKENS_PER_SECOND = 20.0
# Speeds are measured after the agents' prompts are in (100,000-token prefills take a few seconds).
SETTLED_AFTER_JOIN_SECONDS = 30.0
BEFORE_FROM_SECONDS = 30.0


MODES = ("shared", "pools", "one-pool")


@dataclass(frozen=True)
class GatewayRun:
    """Per-request decode speeds (tokens/s of one stream) by phase, and what admission decided."""

    mode: str
    chat_tokens_per_second_before: float  # median over chats that streamed before the agents joined
    chat_tokens_per_second_during: float  # median over chats that streamed while the agents ran
    chat_requests_during: int
    agent_tokens_per_second_during: float  # NaN when no agent was sent
    agent_targets: tuple[str, ...]  # where each agent that was sent ran
    decisions: dict[tuple[str, str], int]
    longest_chat_wait_seconds: float  # longest a chat waited at the gateway for admission


@dataclass
class _Pending:
    group: str
    prompt_tokens: int
    max_output_tokens: int
    arrived_seconds: float
    user: int | None = None
    leave_at_seconds: float | None = None
    ask_again_at_seconds: float = 0.0  # a refusal's Retry-After


@dataclass
class _Gateway:
    sims: dict[str, Simulator]
    book: AdmissionBook | None
    pools: bool
    chats: ClosedLoopGroup
    rng: random.Random
    poll_interval_seconds: float
    now_seconds: float = 0.0
    pending: deque[_Pending] = field(default_factory=deque)
    arrivals: list[tuple[float, int, _Pending]] = field(default_factory=list)
    order: Any = field(default_factory=itertools.count)
    sent: list[tuple[_Pending, SimRequest, str]] = field(default_factory=list)
    longest_chat_wait_seconds: float = 0.0

    def schedule(self, at_seconds: float, pending: _Pending) -> None:
        heapq.heappush(self.arrivals, (at_seconds, next(self.order), pending))

    def chat_request(self, user: int, at_seconds: float) -> _Pending:
        return _Pending("chat", self.chats.prompt_tokens.draw(self.rng), self.chats.output_tokens.draw(self.rng),
                        at_seconds, user=user)

    def take_arrivals(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.now_seconds:
            _, _, pending = heapq.heappop(self.arrivals)
            pending.arrived_seconds = max(pending.arrived_seconds, self.now_seconds)
            self.pending.append(pending)

    def send_pending(self) -> None:
        """Ask for each waiting request in arrival order; refused ones keep their place and ask
        again after the refusal's Retry-After."""
        waiting: deque[_Pending] = deque()
        while self.pending:
            pending = self.pending.popleft()
            if pending.ask_again_at_seconds > self.now_seconds or not self._try_send(pending):
                waiting.append(pending)
        self.pending = waiting

    def _try_send(self, pending: _Pending) -> bool:
        target, admission_id = CHAT_TARGET, None
        if self.book is not None:
            where = {"pool": "auto"} if self.pools else {"deployment": "chat"}
            decision = self.book.admit(AdmissionRequest(pending.prompt_tokens, pending.max_output_tokens, **where))
            if decision.admission is None:
                wait_seconds = decision.retry_after_seconds or self.poll_interval_seconds
                pending.ask_again_at_seconds = self.now_seconds + wait_seconds
                return False
            target, admission_id = decision.admission.target, decision.admission.id
        if pending.group == "chat":
            self.longest_chat_wait_seconds = max(self.longest_chat_wait_seconds,
                                                 self.now_seconds - pending.arrived_seconds)
        request = self.sims[target].submit(
            pending.prompt_tokens, pending.max_output_tokens, arrival_seconds=self.now_seconds, group=pending.group,
            user=pending.user, leave_at_seconds=pending.leave_at_seconds, finish_reason_at_max="stop",
            on_finish=functools.partial(self._finished, pending=pending, admission_id=admission_id))
        self.sent.append((pending, request, target))
        return True

    def _finished(self, request: SimRequest, *, pending: _Pending, admission_id: str | None) -> None:
        if self.book is not None and admission_id is not None:
            self.book.release(admission_id)
        if pending.user is not None:
            at = (request.finished_seconds or self.now_seconds) + self.chats.think_seconds
            self.schedule(at, self.chat_request(pending.user, at))


def gateway_config(poll_interval_seconds: float) -> Config:
    """Two deployments of Qwen3-8B on H100s: chats (50 tok/s) and the long-context pool (20 tok/s)."""
    def deployment(name: str, target: str, speed: float) -> dict[str, Any]:
        return {"name": name, "model": "qwen3-8b", "gpu": "h100-sxm", "target_tokens_per_second": speed,
                "targets": {"static": [f"http://{target}/metrics"]}}

    return config_from_mapping({
        "poll_interval": f"{poll_interval_seconds:g}s",
        "deployments": [deployment("chat", CHAT_TARGET, CHAT_TARGET_TOKENS_PER_SECOND),
                        deployment("agents", AGENTS_TARGET, AGENTS_TARGET_TOKENS_PER_SECOND)],
        "pools": {"short": "chat", "long": "agents", "split_tokens": SPLIT_TOKENS},
    })


def scenario_groups(scenario: Scenario) -> tuple[ClosedLoopGroup, ScriptedGroup]:
    chats = next(g for g in scenario.groups if isinstance(g, ClosedLoopGroup))
    agents = next(g for g in scenario.groups if isinstance(g, ScriptedGroup))
    return chats, agents


def run_agents_join(mode: str, *, until_seconds: float = AGENTS_JOIN_SECONDS + 180.0,
                    tick_seconds: float = 0.05, poll_interval_seconds: float = 15.0, seed: int = 0) -> GatewayRun:
    """Replay `agents-join` through a gateway in simulated time and measure every stream's speed."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    config = gateway_config(poll_interval_seconds)
    clock = _SimulatedClock()
    book = None
    if mode != "shared":
        book = book_from_config(config, clock=clock, with_pools=mode == "pools")
    sims = {CHAT_TARGET: Simulator(ServerSpec(seed=seed)), AGENTS_TARGET: Simulator(ServerSpec(seed=seed + 1))}
    chats, agents = scenario_groups(load_scenario("agents-join"))
    gateway = _Gateway(sims, book, mode == "pools", chats, random.Random(seed), poll_interval_seconds)
    for user in range(chats.users):
        at = chats.first_arrival_seconds(user, gateway.rng)
        gateway.schedule(at, gateway.chat_request(user, at))
    spec = sims[AGENTS_TARGET].spec
    for _ in range(agents.count):
        prompt, output = spec.fit_context(agents.prompt_tokens.draw(gateway.rng),
                                          agents.output_tokens.draw(gateway.rng))
        gateway.schedule(agents.at_seconds, _Pending("agent", prompt, output, agents.at_seconds,
                                                     leave_at_seconds=agents.leave_at_seconds))

    def fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        return sims[url.split("//", 1)[1].split("/", 1)[0]].render_metrics().decode()

    poller = Poller(config, Discovery(config.deployments, timeout_seconds=1.0), fetch,
                    clock=clock, monotonic=clock)
    if book is not None:
        sync_at_every_poll(book, poller)
    try:
        _drive(gateway, poller, clock, until_seconds, tick_seconds, poll_interval_seconds)
    finally:
        poller.stop()
    return _summarise(gateway, mode, agents.at_seconds, min(until_seconds, agents.leave_at_seconds or until_seconds))


@dataclass
class _SimulatedClock:
    now_seconds: float = 0.0

    def __call__(self) -> float:
        return self.now_seconds


def _drive(gateway: _Gateway, poller: Poller, clock: _SimulatedClock, until_seconds: float,
           tick_seconds: float, poll_interval_seconds: float) -> None:
    next_poll = 0.0
    for tick in itertools.count(1):
        now = tick * tick_seconds
        if now > until_seconds:
            return
        clock.now_seconds = gateway.now_seconds = now
        for sim in gateway.sims.values():
            sim.run_until(now)
        if now >= next_poll:
            poller.poll_once()
            next_poll += poll_interval_seconds
        gateway.take_arrivals()
        gateway.send_pending()


def _stream_speed(request: SimRequest) -> float | None:
    """One stream's decode speed: tokens after the first over the time they took."""
    if request.first_token_seconds is None or request.last_token_seconds is None or request.output_tokens < 2:
        return None
    seconds = request.last_token_seconds - request.first_token_seconds
    return (request.output_tokens - 1) / seconds if seconds > 0 else None


def _median_speed(requests: list[SimRequest], start: float, end: float) -> tuple[float, int]:
    """Median speed of the streams that decoded wholly inside [start, end)."""
    speeds = [speed for r in requests
              if r.first_token_seconds is not None and r.last_token_seconds is not None
              and start <= r.first_token_seconds and r.last_token_seconds < end
              and (speed := _stream_speed(r)) is not None]
    return (statistics.median(speeds) if speeds else float("nan")), len(speeds)


def _summarise(gateway: _Gateway, mode: str, join_seconds: float, leave_seconds: float) -> GatewayRun:
    chats = [request for pending, request, _ in gateway.sent if pending.group == "chat"]
    agents = [(request, target) for pending, request, target in gateway.sent if pending.group == "agent"]
    settled = join_seconds + SETTLED_AFTER_JOIN_SECONDS
    before, _ = _median_speed(chats, BEFORE_FROM_SECONDS, join_seconds)
    during, count = _median_speed(chats, settled, leave_seconds)
    # Agents rarely finish inside the run: their speed is their average from first token so far.
    agent_speeds = [speed for r, _ in agents if (speed := _stream_speed(r)) is not None]
    return GatewayRun(
        mode=mode, chat_tokens_per_second_before=before, chat_tokens_per_second_during=during,
        chat_requests_during=count,
        agent_tokens_per_second_during=statistics.median(agent_speeds) if agent_speeds else float("nan"),
        agent_targets=tuple(target for _, target in agents),
        decisions=gateway.book.decision_counts() if gateway.book is not None else {},
        longest_chat_wait_seconds=gateway.longest_chat_wait_seconds,
    )


def format_run(run: GatewayRun) -> str:
    where = ", ".join(sorted(set(run.agent_targets))) or "nowhere (still waiting at the gateway)"
    return (f"{run.mode}: chats {run.chat_tokens_per_second_before:.1f} tok/s before the agents, "
            f"{run.chat_tokens_per_second_during:.1f} tok/s with them ({run.chat_requests_during} chat streams); "
            f"agents {run.agent_tokens_per_second_during:.1f} tok/s on {where}; "
            f"longest chat wait {run.longest_chat_wait_seconds:.2f} s")

