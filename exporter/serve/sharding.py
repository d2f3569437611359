"""Sharding: `serve --shard INDEX/COUNT` (or config `shard: {index, count}`) polls only this
replica's share of the targets, so a StatefulSet of COUNT replicas covers a fleet one process
cannot keep up with.

Why rendezvous (highest-random-weight) hashing: every replica decides alone, from the target's URL
and the shard count, with no coordination; each target lands in exactly one shard; and going from
K to K+1 shards moves only the targets whose weight for the new shard beats their old winner,
about 1/(K+1) of them, all into the new shard (Thaler & Ravishankar, "Using name-based mappings to
increase hit rates", 1998). The hash is BLAKE2b of the bytes, the same in every process and on
every machine (Python's `hash()` of a string is salted per process and would reshuffle on restart).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from exporter.config_validators import REQUIRED, Invalid, Key, Section, Where, whole_non_negative, whole_positive
from exporter.errors import InputError

if TYPE_CHECKING:
    from exporter.serve.config_model import Config
    from exporter.serve.discovery import NotReadyPod, Target

log = structlog.get_logger("stepbudget.sharding")

_SHARD_RE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """This replica's place: shard `index` of `count` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise InputError(f"shard count must be at least 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise InputError(f"shard index must satisfy 0 <= INDEX < COUNT, got {self.index}/{self.count}"
                             f" (indexes of {self.count} shard(s) run 0..{self.count - 1})")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """`INDEX/COUNT` as given to `--shard`; a clear InputError otherwise (exit 2)."""
    match = _SHARD_RE.fullmatch(text)
    if match is None:
        hint = ""
        if text.startswith("$(") or text.startswith("/"):
            # A Kubernetes `$(VAR)` left unexpanded or expanded to nothing: the pod-index label is missing.
            hint = " (the pod's index is empty: on Kubernetes the pod label apps.kubernetes.io/pod-index needs >= 1.28)"
        raise InputError(f"--shard {text!r}: expected INDEX/COUNT with whole numbers, e.g. 0/3{hint}")
    try:
        return Shard(int(match.group(1)), int(match.group(2)))
    except InputError as error:
        raise InputError(f"--shard {text!r}: {error}") from None


def shard_weight(identity: str, index: int) -> int:
    """The rendezvous weight of one target for one shard: 64 bits of BLAKE2b, stable everywhere."""
    digest = hashlib.blake2b(f"{index}\x00{identity}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@functools.lru_cache(maxsize=1 << 16)  # the same targets come back every poll: hash each once
def shard_of(identity: str, count: int) -> int:
    """The shard (0..count-1) that owns `identity`: the one with the highest weight (ties: lowest index)."""
    if count < 1:
        raise ValueError(f"shard count must be at least 1, got {count}")
    best_index, best_weight = 0, -1
    for index in range(count):
        weight = shard_weight(identity, index)
        if weight > best_weight:
            best_index, best_weight = index, weight
    return best_index


def target_identity(target: Target) -> str:
    """What a target is hashed by: its URL (the same server in two deployments stays together)."""
    return target.url


def keep_targets(targets: Sequence[Target], shard: Shard) -> list[Target]:
    """The targets this shard polls, in their discovery order."""
    if shard.count == 1:
        return list(targets)
    return [target for target in targets if shard_of(target_identity(target), shard.count) == shard.index]


class _Discovers(Protocol):
    def discover(self) -> list[Target]: ...


class ShardedDiscovery:
    """Wraps the daemon's Discovery: every discovered list is cut down to this shard's targets."""

    def __init__(self, discovery: _Discovers, shard: Shard) -> None:
        self._discovery = discovery
        self.shard = shard
        self._last_counts: tuple[int, int] | None = None

    def discover(self) -> list[Target]:
        everything = self._discovery.discover()
        mine = keep_targets(everything, self.shard)
        counts = (len(mine), len(everything))
        if counts != self._last_counts:
            log.info("shard_targets", shard=str(self.shard), polled=counts[0], discovered=counts[1])
            self._last_counts = counts
        return mine

    def not_ready(self) -> list[NotReadyPod]:
        """This shard's share of the pods not Ready yet (by namespace/pod): each is reported, and
        warned about, by one shard; Prometheus's `max without (instance, job)` sees them all."""
        pods: list[NotReadyPod] = getattr(self._discovery, "not_ready", list)()
        if self.shard.count == 1:
            return list(pods)
        return [pod for pod in pods if shard_of(f"{pod.namespace}/{pod.pod}", self.shard.count) == self.shard.index]


# --- config: the `shard` section (listed by config.top_level_keys) --------------------------------


def check_shard_section(result: Mapping[str, Any], where: Where) -> None:
    """The index must name one of the shards: the schema alone cannot compare two keys."""
    if not 0 <= result["index"] < result["count"]:
        raise Invalid(f"index must satisfy 0 <= index < count, got index {result['index']}"
                      f" with count {result['count']} (indexes run 0..{result['count'] - 1})")


SHARD_SECTION = Section("shard", {
    "index": Key(whole_non_negative, REQUIRED, "this replica's shard, 0..count-1"),
    "count": Key(whole_positive, REQUIRED, "how many shards (replicas)"),
}, "poll only this replica's share of the targets (rendezvous hashing on the URL; docs/scaling.md)",
    check=check_shard_section)


def shard_from_config(config: Config) -> Shard | None:
    """The config's `shard` section as a Shard, or None when the daemon polls every target."""
    raw = config.sections.get("shard")
    if not raw:
        return None
    return Shard(raw["index"], raw["count"])


def shard_section(shard: Shard) -> dict[str, int]:
    """The `shard` section a `--shard` flag puts into the config document (validated like the file)."""
    return {"index": shard.index, "count": shard.count}
