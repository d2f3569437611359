"""Workloads that drive the simulated server: built-in scenarios and YAML files.

A scenario is a list of request groups on a simulated-time line:
  * `closed` — N users, each sending its next request when the previous one finishes (plus a
    think time): keeps about N requests in flight, like chat users;
  * `poisson` — open-loop arrivals at a rate per second (Poisson process) between start and stop;
  * `scripted` — `count` requests at a fixed time, optionally leaving at `leave_at` (an agent
    session that ends while still generating).
Token counts are drawn uniformly in mean x (1 ± spread). Any group may say that a share of each
prompt is already in the prefix cache (`cached`: an agent re-sending its conversation), and that all
its prompts begin with one common prefix (`shared_prefix_tokens`: a system prompt, followed by each
request's own `prompt_tokens`), cached once and shared by the group's running requests. A scenario
may also set up the server (`settings`: vLLM release line, data-parallel engines, KV cache dtype),
over the defaults and under explicit command-line flags. The YAML format is in docs/simulator.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from exporter.errors import InputError
from exporter.suggest import close_names

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class TokenCount:
    """A token count drawn uniformly in mean x (1 ± spread_ratio), at least 1."""

    mean: int
    spread_ratio: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.spread_ratio == 0:
            return self.mean
        low, high = self.mean * (1 - self.spread_ratio), self.mean * (1 + self.spread_ratio)
        return max(1, round(rng.uniform(low, high)))


@dataclass(frozen=True)
class ClosedLoopGroup:
    name: str
    users: int
    prompt_tokens: TokenCount
    output_tokens: TokenCount
    think_seconds: float = 0.0
    start_seconds: float = 0.0
    stop_seconds: float | None = None
    ramp_seconds: float = 10.0  # users start spread over this long, so their requests do not move in lockstep
    cached_ratio: float = 0.0  # share of each prompt already in the prefix cache
    shared_prefix_tokens: int = 0  # every prompt begins with this common prefix, then its own prompt_tokens

    def first_arrival_seconds(self, user: int, rng: random.Random) -> float:
        """When `user` (0 to users - 1) sends its first request: a random moment in its share of the ramp."""
        return self.start_seconds + self.ramp_seconds * (user + rng.random()) / self.users


@dataclass(frozen=True)
class PoissonGroup:
    name: str
    rate_per_second: float
    prompt_tokens: TokenCount
    output_tokens: TokenCount
    start_seconds: float = 0.0
    stop_seconds: float | None = None
    cached_ratio: float = 0.0
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class ScriptedGroup:
    name: str
    at_seconds: float
    prompt_tokens: TokenCount
    output_tokens: TokenCount
    count: int = 1
    leave_at_seconds: float | None = None
    cached_ratio: float = 0.0
    shared_prefix_tokens: int = 0


Group = ClosedLoopGroup | PoissonGroup | ScriptedGroup
Spec = TypeVar("Spec", bound="DataclassInstance")


@dataclass(frozen=True)
class ScenarioSettings:
    """Server settings a scenario asks for (None: keep the server's own); names as ServerSpec's."""

    vllm_version: str | None = None
    data_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    enable_prefix_caching: bool | None = None

    def given(self) -> dict[str, Any]:
        """The settings this one sets (the others keep whatever they are laid over)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def applied_to(self, spec: Spec) -> Spec:
        return replace(spec, **self.given())

    def overridden_by(self, other: ScenarioSettings) -> ScenarioSettings:
        return replace(self, **other.given())


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    groups: tuple[Group, ...]
    timeline: tuple[tuple[float, str], ...] = ()  # (simulated seconds, what happens) for people
    settings: ScenarioSettings = field(default_factory=ScenarioSettings)


def _chats(users: int = 40, name: str = "chat") -> ClosedLoopGroup:
    # ~1,500-token prompts and ~1,000-token answers (Qwen3 thinks before it answers): each chat's
    # context grows from ~1,500 to ~2,500 tokens, ~2,000 on average (DESIGN §1's "40 chats x 2,000").
    return ClosedLoopGroup(name, users, TokenCount(1500, 0.2), TokenCount(1000, 0.2), ramp_seconds=10.0)


AGENTS_JOIN_SECONDS = 120.0
AGENTS_LEAVE_SECONDS = 420.0
CACHED_AGENT_CONTEXT_TOKENS = 100_000
CACHED_AGENT_CACHED_RATIO = 0.99


def _cached_agents(sessions: int = 2) -> ClosedLoopGroup:
    # Tool-calling agents: every turn re-sends the whole ~100,000-token conversation, 99% of it
    # already in the prefix cache, and answers with a short ~100-token tool call; the tool returns at once.
    return ClosedLoopGroup("agent", sessions, TokenCount(CACHED_AGENT_CONTEXT_TOKENS, 0.02), TokenCount(100, 0.2),
                           ramp_seconds=10.0, cached_ratio=CACHED_AGENT_CACHED_RATIO)


SHARED_PREFIX_TOKENS = 4000
SHARED_PREFIX_USERS = 48


def _shared_prefix_chats(users: int = SHARED_PREFIX_USERS) -> ClosedLoopGroup:
    # Chat users of one assistant: every prompt is the same ~4,000-token system prompt plus ~400 tokens
    # of its own, answered in ~300. Each decode step reads every user's whole ~4,500-token context while
    # the cache holds the system prompt once: tokens in flight and KV used differ about 7-fold.
    return ClosedLoopGroup("assistant", users, TokenCount(400, 0.25), TokenCount(300, 0.25), ramp_seconds=10.0,
                           shared_prefix_tokens=SHARED_PREFIX_TOKENS)


def builtin_scenarios() -> dict[str, Scenario]:
    return {
        "idle": Scenario("idle", "no background load: only requests sent to /v1/completions (for calibration)", ()),
        "steady-chat": Scenario(
            "steady-chat", "40 chat users, ~1,500-token prompts and ~1,000-token answers, back to back",
            (_chats(),), ((0.0, "40 chat users start over the first 10 s"),)),
        "agents-join": Scenario(
            "agents-join",
            "steady-chat, then two ~100,000-token agent sessions join and later leave: the step time about doubles",
            (_chats(), ScriptedGroup("agent", AGENTS_JOIN_SECONDS, TokenCount(100_000), TokenCount(50_000), count=2,
                                     leave_at_seconds=AGENTS_LEAVE_SECONDS)),
            ((0.0, "40 chat users start"), (AGENTS_JOIN_SECONDS, "2 agent sessions of ~100,000 tokens join"),
             (AGENTS_LEAVE_SECONDS, "the agent sessions leave"))),
        "prefill-burst": Scenario(
            "prefill-burst",
            "32 chats stream while 8,000-token prompts (short answers) arrive faster than prefill absorbs them",
            (_chats(32), PoissonGroup("document", 3.0, TokenCount(8000, 0.1), TokenCount(4), start_seconds=60.0,
                                      stop_seconds=240.0)),
            ((0.0, "32 chat users start"), (60.0, "8,000-token prompts start arriving, 3 per second"),
             (240.0, "the burst ends"))),
        "agents-cached": Scenario(
            "agents-cached",
            "steady-chat plus two agent sessions re-sending ~100,000-token conversations, 99% from the prefix cache, "
            "for ~100-token tool calls (vLLM 0.33 page)",
            (_chats(), _cached_agents()),
            ((0.0, "40 chat users and 2 agent sessions start; "
                   "each agent turn computes only ~1,000 new prompt tokens"),),
            ScenarioSettings(vllm_version="0.33")),
        "shared-prefix": Scenario(
            "shared-prefix",
            "48 chat users whose prompts all begin with one 4,000-token system prompt, each adding ~400 tokens "
            "and answering ~300: ~220,000 tokens in flight read per step, ~30,000 held in the cache",
            (_shared_prefix_chats(),),
            ((0.0, "48 users start over the first 10 s; once the first prompt has scheduled the system prompt, "
                   "every later one hits it in the prefix cache and computes only its own ~400 tokens"),)),
        "overload": Scenario(
            "overload",
            "64 users with ~6,000-token prompts and ~2,000-token answers: more context than the cache holds",
            (ClosedLoopGroup("long-chat", 64, TokenCount(6000, 0.2), TokenCount(2000, 0.2), ramp_seconds=5.0),),
            ((0.0, "64 long-context users start: the cache fills and requests get preempted"),)),
    }


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML file (docs/simulator.md)."""
    builtins = builtin_scenarios()
    if name_or_path in builtins:
        return builtins[name_or_path]
    path = Path(name_or_path)
    if not (name_or_path.endswith((".yaml", ".yml")) or path.exists()):
        raise InputError(f"--scenario: unknown scenario {name_or_path!r}{close_names(name_or_path, builtins)}; "
                         f"built in: {', '.join(builtins)}, or a path to a YAML file")
    try:
        text = path.read_text()
    except OSError as error:
        raise InputError(f"--scenario: cannot read {name_or_path}: {error.strerror}") from error
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InputError(f"{name_or_path}: not valid YAML: {error}") from error
    return scenario_from_dict(document, where=name_or_path)


_COMMON_GROUP_KEYS = {"name", "kind", "prompt_tokens", "output_tokens", "cached", "shared_prefix_tokens"}
_GROUP_KEYS = {
    "closed": _COMMON_GROUP_KEYS | {"users", "think", "start", "stop", "ramp"},
    "poisson": _COMMON_GROUP_KEYS | {"rate_per_second", "start", "stop"},
    "scripted": _COMMON_GROUP_KEYS | {"at", "count", "leave_at"},
}
_SETTINGS_KEYS = {"vllm_version", "data_parallel_size", "kv_cache_dtype", "enable_prefix_caching"}


def scenario_from_dict(document: Any, where: str = "scenario") -> Scenario:
    if not isinstance(document, dict):
        raise InputError(f"{where}: expected a mapping with keys name, description, groups")
    _no_unknown_keys(document, {"name", "description", "groups", "settings"}, where)
    groups_doc = document.get("groups")
    if not isinstance(groups_doc, list) or not groups_doc:
        raise InputError(f"{where}: 'groups' must be a non-empty list")
    groups = tuple(_group(item, f"{where}: groups[{index}]") for index, item in enumerate(groups_doc))
    names = [group.name for group in groups]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"{where}: group names must be unique; repeated: {', '.join(duplicates)}")
    return Scenario(str(document.get("name", Path(where).stem)), str(document.get("description", "")), groups,
                    settings=_settings(document.get("settings", {}), f"{where}: settings"))


def _settings(doc: Any, where: str) -> ScenarioSettings:
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a mapping with keys {', '.join(sorted(_SETTINGS_KEYS))}")
    _no_unknown_keys(doc, _SETTINGS_KEYS, where)
    size = doc.get("data_parallel_size")
    caching = doc.get("enable_prefix_caching")
    if caching is not None and not isinstance(caching, bool):
        raise InputError(f"{where}.enable_prefix_caching: must be true or false, got {caching!r}")
    return ScenarioSettings(
        vllm_version=None if doc.get("vllm_version") is None else str(doc["vllm_version"]),
        data_parallel_size=None if size is None else int(_number(doc, "data_parallel_size", where, minimum=1,
                                                                 integer=True)),
        kv_cache_dtype=None if doc.get("kv_cache_dtype") is None else str(doc["kv_cache_dtype"]),
        enable_prefix_caching=caching)


def _group(doc: Any, where: str) -> Group:
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a mapping")
    kind = doc.get("kind")
    if kind not in _GROUP_KEYS:
        raise InputError(f"{where}.kind: must be one of {', '.join(_GROUP_KEYS)}, got {kind!r}")
    _no_unknown_keys(doc, _GROUP_KEYS[kind], where)
    name = str(doc.get("name", f"{kind}"))
    prompt = _tokens(doc, "prompt_tokens", where)
    output = _tokens(doc, "output_tokens", where)
    start = _number(doc, "start", where, default=0.0, minimum=0.0)
    cached = _number(doc, "cached", where, default=0.0, minimum=0.0)
    if cached > 1:
        raise InputError(f"{where}.cached: a share of the prompt, 0 to 1, got {cached!r}")
    # The tokens every prompt of the group begins with; prompt_tokens come after them.
    shared = int(_number(doc, "shared_prefix_tokens", where, default=0, minimum=0, integer=True))
    if kind == "closed":
        return ClosedLoopGroup(name, int(_number(doc, "users", where, minimum=1, integer=True)), prompt, output,
                               think_seconds=_number(doc, "think", where, default=0.0, minimum=0.0),
                               start_seconds=start, stop_seconds=_stop(doc, start, where),
                               ramp_seconds=_number(doc, "ramp", where, default=10.0, minimum=0.0),
                               cached_ratio=cached, shared_prefix_tokens=shared)
    if kind == "poisson":
        return PoissonGroup(name, _number(doc, "rate_per_second", where, exclusive_minimum=0.0), prompt, output,
                            start_seconds=start, stop_seconds=_stop(doc, start, where), cached_ratio=cached,
                            shared_prefix_tokens=shared)
    at = _number(doc, "at", where, minimum=0.0)
    leave_at = doc.get("leave_at")
    if leave_at is not None and _number(doc, "leave_at", where) <= at:
        raise InputError(f"{where}.leave_at: must be after at={at:g}, got {leave_at!r}")
    return ScriptedGroup(name, at, prompt, output, count=int(_number(doc, "count", where, default=1, minimum=1,
                                                                     integer=True)),
                         leave_at_seconds=None if leave_at is None else float(leave_at), cached_ratio=cached,
                         shared_prefix_tokens=shared)


def _no_unknown_keys(doc: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in doc:
        if key not in allowed:
            raise InputError(f"{where}: unknown key {key!r}{close_names(str(key), allowed)}; "
                             f"allowed: {', '.join(sorted(allowed))}")


def _number(doc: dict[str, Any], key: str, where: str, default: float | None = None, minimum: float | None = None,
            exclusive_minimum: float | None = None, integer: bool = False) -> float:
    value = doc.get(key, default)
    if value is None:
        raise InputError(f"{where}.{key}: required")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and value != int(value)):
        raise InputError(f"{where}.{key}: must be {'a whole' if integer else 'a'} number, got {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{where}.{key}: must be at least {minimum:g}, got {value!r}")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise InputError(f"{where}.{key}: must be greater than {exclusive_minimum:g}, got {value!r}")
    return float(value)


def _stop(doc: dict[str, Any], start: float, where: str) -> float | None:
    if doc.get("stop") is None:
        return None
    stop = _number(doc, "stop", where)
    if stop <= start:
        raise InputError(f"{where}.stop: must be after start={start:g}, got {stop!r}")
    return stop


def _tokens(doc: dict[str, Any], key: str, where: str) -> TokenCount:
    """`prompt_tokens: 1500` or `prompt_tokens: {mean: 1500, spread: 0.2}`."""
    value = doc.get(key)
    if value is None:
        raise InputError(f"{where}.{key}: required (a token count, or {{mean: N, spread: 0.2}})")
    if isinstance(value, dict):
        _no_unknown_keys(value, {"mean", "spread"}, f"{where}.{key}")
        mean = _number(value, "mean", f"{where}.{key}", minimum=1, integer=True)
        spread = _number(value, "spread", f"{where}.{key}", default=0.0, minimum=0.0)
        if spread >= 1:
            raise InputError(f"{where}.{key}.spread: must be below 1, got {spread!r}")
        return TokenCount(int(mean), spread)
    return TokenCount(int(_number(doc, key, where, minimum=1, integer=True)))
