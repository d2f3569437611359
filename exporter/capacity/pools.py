"""`stepbudget plan --pools`: the numbers behind routing long sessions to their own GPUs.

Every request in a batch gets one token per step, and a step reads every running request's KV
cache, so two 100,000-token agent sessions slow forty 2,000-token chats as much as they slow
themselves. This module splits a mix (`--load` lines) at a context size (`--split`) into a short
and a long class and predicts each class's per-user speed:
  * shared: the whole mix on one replica (what a single pool does when the sessions land together);
  * own pool: each class on its own replica, without the other;
and the replicas each arrangement needs to hold the speed target within the KV cache (requests
spread evenly, the busiest replica counted). Pure: built from `exporter.capacity.model` and the planner's Plan.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from exporter.capacity import kv_cache, model
from exporter.capacity.model import RequestGroup, ServingSetup
from exporter.errors import InputError

DEFAULT_SPLIT_TOKENS = 32_000


@dataclass(frozen=True)
class PoolSpeed:
    """One set of loads on replicas of its own."""

    loads: tuple[RequestGroup, ...]
    tokens_in_flight: float
    step_seconds: float  # all of the loads on one replica
    user_tokens_per_second: float
    meets_target: bool
    # The fewest replicas that hold the target with the loads spread evenly; None when one
    # request of the longest context alone misses it.
    replicas_for_target: int | None

    @property
    def requests(self) -> int:
        return sum(group.count for group in self.loads)


@dataclass(frozen=True)
class PoolsPlan:
    split_tokens: float
    target_tokens_per_second: float
    step_budget_seconds: float
    token_budget_tokens: float
    kv_capacity_tokens: int  # per replica: at a slow target the speed budget can exceed it
    shared: PoolSpeed
    short: PoolSpeed | None  # loads with context <= split, on their own replicas
    long: PoolSpeed | None  # loads with context > split, on their own replicas

    @property
    def split_replicas_for_target(self) -> int | None:
        needed = [pool.replicas_for_target for pool in (self.short, self.long) if pool is not None]
        return None if any(n is None for n in needed) else sum(n for n in needed if n is not None)


def split_loads(loads: Sequence[RequestGroup], split_tokens: float) -> tuple[list[RequestGroup], list[RequestGroup]]:
    """Short (context <= split) and long (context > split) loads, in their given order."""
    return ([g for g in loads if g.context_tokens <= split_tokens],
            [g for g in loads if g.context_tokens > split_tokens])


def busiest_replica(loads: Sequence[RequestGroup], replicas: int) -> list[RequestGroup]:
    """Each group spread evenly over `replicas`: the busiest replica gets ceil(count / replicas) of each."""
    return [RequestGroup(math.ceil(g.count / replicas), g.context_tokens) for g in loads if g.count]


def _fits(setup: ServingSetup, loads: Sequence[RequestGroup], step_budget_seconds: float) -> bool:
    """The loads' step fits the budget and their tokens fit the KV cache."""
    step = model.predict_step(setup, list(loads))
    return step.step_seconds <= step_budget_seconds and step.tokens_in_flight <= kv_cache.kv_capacity_tokens(setup)


def replicas_for_target(setup: ServingSetup, loads: Sequence[RequestGroup], step_budget_seconds: float) -> int | None:
    """The fewest replicas whose busiest one fits the step budget and the KV cache (None: one
    request of the longest context alone does not)."""
    if not loads:
        return 0
    longest = max(group.context_tokens for group in loads)
    if not _fits(setup, [RequestGroup(1, longest)], step_budget_seconds):
        return None
    most = max(group.count for group in loads)
    # More replicas never make the busiest one busier, so bisect on "the busiest replica fits".
    low, high = 1, most
    while low < high:
        middle = (low + high) // 2
        if _fits(setup, busiest_replica(loads, middle), step_budget_seconds):
            high = middle
        else:
            low = middle + 1
    return low


def pool_speed(setup: ServingSetup, loads: Sequence[RequestGroup], step_budget_seconds: float) -> PoolSpeed:
    step = model.predict_step(setup, list(loads))
    return PoolSpeed(
        loads=tuple(loads), tokens_in_flight=step.tokens_in_flight, step_seconds=step.step_seconds,
        user_tokens_per_second=step.user_tokens_per_second,
        meets_target=step.step_seconds <= step_budget_seconds,
        replicas_for_target=replicas_for_target(setup, loads, step_budget_seconds),
    )


def plan_pools(setup: ServingSetup, loads: Sequence[RequestGroup], split_tokens: float, *,
               target_tokens_per_second: float, headroom: float = model.DEFAULT_HEADROOM) -> PoolsPlan:
    if not loads:
        raise InputError("--pools needs the mix: give --load COUNTxTOKENS (repeatable), "
                         "e.g. --load 40x2000 --load 2x100000")
    if not split_tokens > 0:
        raise InputError(f"--split must be greater than zero, got {split_tokens!r}")
    budget = model.step_budget_seconds(target_tokens_per_second, headroom)
    short, long = split_loads(loads, split_tokens)
    mean_context = sum(g.tokens for g in loads) / sum(g.count for g in loads)
    context = None if model.budget_has_closed_form(setup) else mean_context
    return PoolsPlan(
        split_tokens=split_tokens, target_tokens_per_second=target_tokens_per_second, step_budget_seconds=budget,
        token_budget_tokens=model.token_budget_tokens(setup, budget, context),
        kv_capacity_tokens=kv_cache.kv_capacity_tokens(setup),
        shared=pool_speed(setup, loads, budget),
        short=pool_speed(setup, short, budget) if short else None,
        long=pool_speed(setup, long, budget) if long else None,
    )


# --- the `plan` verb's --pools and --split flags ---------------------------------------------------


def add_pools_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pools (plan --pools)")
    group.add_argument("--pools", action="store_true",
                       help="per-user speed of each class of the --load mix: "
                            "one shared pool vs long sessions on their own GPUs")
    group.add_argument("--split", metavar="TOKENS",
                       help="context above which a request belongs to the long-context pool "
                            f"(default {DEFAULT_SPLIT_TOKENS:,})")


def parse_split(text: str | None) -> float:
    if text is None:
        return float(DEFAULT_SPLIT_TOKENS)
    try:
        value = float(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise InputError(f"--split {text!r}: expected a number of tokens, e.g. 32000") from None
    if not value > 0 or not math.isfinite(value):
        raise InputError(f"--split {text!r}: must be a positive number of tokens")
    return value


def run_if_asked(plan: Any, args: argparse.Namespace) -> int | None:
    """`plan` calls this with the Plan it built: with --pools, print the pools comparison and
    return the exit code; without, None (and --split alone is an error)."""
    if not getattr(args, "pools", False):
        if getattr(args, "split", None) is not None:
            raise InputError("--split only applies with --pools")
        return None
    loads = plan.load_prediction.loads if plan.load_prediction is not None else ()
    pools = plan_pools(plan.setup, loads, parse_split(args.split),
                       target_tokens_per_second=plan.target_tokens_per_second, headroom=plan.headroom)
    print(json.dumps(pools_to_json(pools), indent=2) if args.json else format_pools(pools))
    return 0


def _speed_json(pool: PoolSpeed | None) -> dict[str, Any] | None:
    if pool is None:
        return None
    return {
        "loads": [{"count": g.count, "context_tokens": g.context_tokens} for g in pool.loads],
        "requests": pool.requests,
        "tokens_in_flight": pool.tokens_in_flight,
        "predicted_step_seconds": pool.step_seconds,
        "predicted_tokens_per_second_per_user": pool.user_tokens_per_second,
        "meets_target": pool.meets_target,
        "replicas_for_target": pool.replicas_for_target,
    }


def pools_to_json(pools: PoolsPlan) -> dict[str, Any]:
    return {
        "split_tokens": pools.split_tokens,
        "target_tokens_per_second": pools.target_tokens_per_second,
        "step_budget_seconds": pools.step_budget_seconds,
        "token_budget_tokens": pools.token_budget_tokens,
        "kv_capacity_tokens": pools.kv_capacity_tokens,
        "shared": _speed_json(pools.shared),
        "short": _speed_json(pools.short),
        "long": _speed_json(pools.long),
        "split_replicas_for_target": pools.split_replicas_for_target,
    }


def loads_text(loads: Sequence[RequestGroup]) -> str:
    return " + ".join(f"{g.count}x{g.context_tokens:,.0f}" for g in loads)


def _replicas_text(replicas: int | None) -> str:
    return "never (one request alone misses)" if replicas is None else f"{replicas}"


def format_pools(pools: PoolsPlan) -> str:
    target = pools.target_tokens_per_second
    rows = [("class", "loads", "shared pool", "own pool", "own-pool replicas for target")]
    shared = pools.shared
    for name, pool in (("short", pools.short), ("long", pools.long)):
        if pool is None:
            continue
        rows.append((f"{name} ({'<=' if name == 'short' else '>'} {pools.split_tokens:,.0f})", loads_text(pool.loads),
                     f"{shared.user_tokens_per_second:,.1f} tok/s", f"{pool.user_tokens_per_second:,.1f} tok/s",
                     _replicas_text(pool.replicas_for_target)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    split_total = pools.split_replicas_for_target
    lines = [
        f"target {target:g} tok/s per user: step budget {pools.step_budget_seconds * 1e3:,.2f} ms, "
        f"token budget {pools.token_budget_tokens:,.0f} tokens in flight per replica "
        f"(KV cache holds {pools.kv_capacity_tokens:,})",
        f"shared pool, one replica: {shared.tokens_in_flight:,.0f} tokens in flight, every user "
        f"{shared.user_tokens_per_second:,.1f} tok/s ({'meets' if shared.meets_target else 'MISSES'} the target)",
        "",
        *table,
        "",
        f"replicas to hold {target:g} tok/s: shared pool {_replicas_text(shared.replicas_for_target)}, "
        f"split pools {_replicas_text(split_total)}",
    ]
    return "\n".join(lines)
