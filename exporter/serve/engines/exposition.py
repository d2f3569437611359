"""A small, fast reader of the Prometheus text exposition format, for model servers' /metrics pages.

Why not `prometheus_client.parser`: it parses every label of every line (~4.6 MB/s), while an
engine adapter needs a dozen families out of a 20 KB page. This reader looks at the sample name
first and parses labels and value only for the exact names asked for, so a real vLLM page costs a
fraction of a millisecond. It never guesses: exact sample names (`vllm:prompt_tokens_total` is not
`vllm:prompt_tokens_cached_total` nor `vllm:prompt_tokens_created`), escaped label values decoded
(`\\\\`, `\\"`, `\\n`), and anything it cannot read is skipped and counted, not misread.

Format reference: prometheus/docs `content/docs/instrumenting/exposition_formats.md` (text format
0.0.4): `name{label="value",...} value [timestamp]`, `#` comment lines, lines end with `\\n`.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

from exporter.serve.snapshot import Histogram


class PageError(Exception):
    """The page is unusable (not Prometheus text, or none of the families a known engine needs).

    `reason` is a short phrase for a log line and the target's `up 0`; the message adds detail.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


Labels = dict[str, str]

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One `name="value"` pair; the value may hold any character but an unescaped quote or a raw newline.
_LABEL_RE = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)')
_CLOSE_RE = re.compile(r"[ \t]*\}")
_ESCAPE_RE = re.compile(r"\\(.)")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}
# A value is what this grammar allows: [+-]?(digits[.digits]|.digits)([eE][+-]?digits)? | [+-]?(Inf|inf|NaN|nan).
# Python's float() also takes "1_0", "infinity", "\u0661", surrounding whitespace and the like,
# which Prometheus does not write. Without underscores, whitespace and non-ASCII digits, float()'s
# grammar for numbers is this one's; so a token float() reads is a value when it holds only these
# characters, or is one of the spellings below (tests/serve/engines/test_exposition.py checks it against the
# grammar written as a regular expression). Cheaper than matching that expression: ~50 values a page.
_NUMBER_CHARS = "0123456789.eE+-"
_NON_FINITE = frozenset({"Inf", "inf", "NaN", "nan"})  # after at most one sign
# Control characters other than tab, newline and carriage return: text pages never hold them.
_BINARY_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
_BINARY_SHARE = 0.01


@dataclass
class PageScan:
    """Samples of the wanted names, in page order, plus what looked wrong on the page."""

    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    sample_lines: int = 0  # lines that read as samples, wanted or not
    malformed_lines: int = 0
    # The wanted samples as (name, sorted label items), in page order, and their values in the same
    # order, when every wanted line was read through a remembered head (no duplicate, nothing odd):
    # the page's layout, the same from one poll to the next, which the adapters plan once
    # (families.py's Plan). None otherwise; the samples above are what counts either way.
    layout: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] | None = None
    values: list[float] = field(default_factory=list)


def _unescape(value: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _UNESCAPED.get(m.group(1), m.group(0)), value)


def parse_value(token: str) -> float | None:
    """A sample value as Prometheus writes it (`NaN`, `+Inf`, `1.5e+09`), or None if it is not one."""
    try:
        value = float(token)
    except ValueError:
        return None
    if not token.strip(_NUMBER_CHARS):  # digits, point, exponent and signs only: the number grammar
        return value
    return value if (token[1:] if token[0] in "+-" else token) in _NON_FINITE else None


def parse_labels(line: str, start: int) -> tuple[Labels, int] | None:
    """Labels from `{` at `start`; returns them and the index after `}`, or None if malformed."""
    labels: Labels = {}
    pos = start + 1
    while True:
        close = _CLOSE_RE.match(line, pos)
        if close is not None:
            return labels, close.end()
        pair = _LABEL_RE.match(line, pos)
        if pair is None:
            return None
        name, raw = pair.group(1), pair.group(2)
        labels[name] = _unescape(raw) if "\\" in raw else raw
        pos = pair.end()
        if not pair.group(3):  # no comma: the set must close here
            close = _CLOSE_RE.match(line, pos)
            return (labels, close.end()) if close is not None else None


# Every ASCII character _BINARY_RE does not match: deleting them from an ASCII sample leaves the
# ones it matches, counted in C (a tenth of the regex's time on a 4 KB sample).
_TEXT_ASCII = bytes(code for code in range(128) if not _BINARY_RE.match(chr(code)))


def _binary_count(sample: str) -> int:
    """How many characters of `sample` _BINARY_RE matches."""
    if sample.isascii():
        return len(sample.encode("ascii").translate(None, _TEXT_ASCII))
    return len(_BINARY_RE.findall(sample))


def _check_is_text(text: str) -> None:
    if not text.strip():
        raise PageError("empty page")
    head = text.lstrip()[:64].lower()
    if head.startswith("<"):
        raise PageError("not Prometheus text", "the page is HTML/XML")
    sample = text[:4096]  # garbage shows at once; scanning the whole page would cost more than parsing it
    if "\x00" in sample or _binary_count(sample) > _BINARY_SHARE * len(sample):
        raise PageError("not Prometheus text", "the page holds binary data")


def _read_sample(line: str, end: int, name: str, scan: PageScan,
                 seen: set[tuple[str, tuple[tuple[str, str], ...]]]) -> bool:
    """Parses one wanted sample line into `scan`; False if the line is malformed."""
    labels: Labels = {}
    items: tuple[tuple[str, str], ...] = ()
    pos = end
    if pos < len(line) and line[pos] == "{":
        parsed = parse_labels(line, pos)
        if parsed is None:
            return False
        labels, pos = parsed
        items = tuple(sorted(labels.items()))
    tokens = line[pos:].split(None, 2)
    if not tokens or (pos < len(line) and line[pos] not in " \t"):
        return False
    value = parse_value(tokens[0])
    if value is None:
        return False
    key = (name, items)
    series = scan.samples.setdefault(name, [])
    if key in seen:
        # Duplicate series: the later line wins, as Prometheus's own scrape would reject the page.
        scan.problems.append(f"duplicate series {name}{labels}: kept the last value")
        series[:] = [entry for entry in series if entry[0] != labels]
    seen.add(key)
    series.append((labels, value))
    return True


def _any_sample(lines: list[str]) -> bool:
    """Whether any line is a whole sample (name, labels, a number): tells text from a 404 body."""
    for raw in lines:
        line = raw.strip()
        match = _NAME_RE.match(line) if line and line[0] != "#" else None
        if match is None:
            continue
        end = match.end()
        if end < len(line) and line[end] == "{":
            parsed = parse_labels(line, end)
            end = parsed[1] if parsed else -1
        tokens = line[end:].split() if end >= 0 else []
        if tokens and line[end] in " \t" and parse_value(tokens[0]) is not None:
            return True
    return False


# A line's verdict by its head (the line up to its last space, where the value starts), per wanted
# set: a server's page repeats the same heads at every poll and only the values after them change,
# so after the first poll a line costs one rpartition and one dict lookup instead of a name match
# (unwanted lines) or a label parse (wanted ones). Only verdicts that depend on the head alone are
# kept (see _remember); anything else goes through the full per-line reading. Bounded: cleared
# when full (targets come and go).
# A wanted sample's name, labels, and its series key (name, sorted labels), built once per head.
Head = tuple[str, Labels, tuple[str, tuple[tuple[str, str], ...]]]
_SKIP: Head = ("", {}, ("", ()))  # (this very object) a well-formed sample line whose name is not wanted
_HEADS: dict[frozenset[str], dict[str, Head]] = {}
MAX_CACHED_HEADS = 50_000


def _heads_for(wanted: frozenset[str]) -> dict[str, Head]:
    heads = _HEADS.get(wanted)
    if heads is None:
        if len(_HEADS) >= 16:  # a handful of wanted sets exist (one per kind, "auto"): never grows
            _HEADS.clear()
        heads = _HEADS[wanted] = {}
    elif len(heads) >= MAX_CACHED_HEADS:
        heads.clear()
    return heads


def _remember(heads: dict[str, Head], raw: str, wanted: frozenset[str]) -> None:
    """Records the verdict of a line the full reading accepted, if it follows from the line's head.

    The head is `raw` up to its last space. The name match stops at that space at the latest (a
    space is not a name character), so "a name followed by `{`, space or tab" is decided by the head.
    A wanted line's head is remembered only when its label set ends exactly where the head does:
    the full reading of `head + " " + value` then parses the same labels (the last `}` of the line
    is the head's last character, since the value holds none when it reads as a number) and reads
    the value from the text after the space, which the fast path checks with the same parse_value.
    """
    head, sep, _ = raw.rpartition(" ")
    # A line starting with a letter is read unstripped: its trailing whitespace is the reader's too.
    if not sep or not head[:1].isalpha():
        return
    match = _NAME_RE.match(head)
    if match is None:
        return
    end = match.end()
    name = head[:end]
    if name not in wanted:
        if end == len(head) or head[end] in "{ \t":
            heads[head] = _SKIP
        return
    if end == len(head):
        heads[head] = (name, {}, (name, ()))
        return
    if head[end] != "{" or head[-1] != "}":
        return
    parsed = parse_labels(head, end)
    if parsed is None or parsed[1] != len(head):
        return
    labels = parsed[0]
    heads[head] = (name, labels, (name, tuple(sorted(labels.items()))))


def scan_page(text: str, wanted: frozenset[str]) -> PageScan:
    """Reads the samples whose names are in `wanted` (exact names) from one page.

    Raises PageError for an empty page, HTML, binary data, or text with no sample line at all.
    Malformed lines are skipped and counted; a last line without its newline is dropped as cut off.
    """
    _check_is_text(text)
    scan = PageScan()
    lines = text.lstrip("\ufeff").split("\n")  # a byte-order mark would hide the first name
    if lines[-1].strip() and not lines[-1].lstrip().startswith("#"):
        scan.problems.append("page ends mid-line (truncated?): its last line was dropped")
    lines.pop()  # the part after the final newline: empty on a complete page
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    first_bad = 0
    heads = _heads_for(wanted)
    samples = scan.samples
    read_value = parse_value
    sample_lines = 0
    layout: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    values = scan.values
    laid_out = True
    for number, raw in enumerate(lines, start=1):
        if raw[:1] == "#":
            continue
        head, sep, value_text = raw.rpartition(" ")
        known = heads.get(head) if sep else None
        if known is _SKIP:  # a sample, not wanted
            sample_lines += 1
            continue
        if known is not None:
            value = read_value(value_text)
            name, labels, key = known
            if value is not None and key not in seen:
                seen.add(key)
                series = samples.get(name)
                if series is None:
                    series = samples[name] = []
                series.append((dict(labels), value))
                layout.append(key)
                values.append(value)
                sample_lines += 1
                continue
        # The full reading: first sight of this head, a duplicate, or anything unusual.
        first = raw[:1]
        # Only a line that starts with whitespace (or is blank) needs stripping: a name starts with a
        # letter, and the readers below take trailing whitespace as a separator.
        line = raw if first.isalpha() else raw.strip()
        if not line or line[0] == "#":
            continue
        match = _NAME_RE.match(line)
        if match is None:  # includes `{"utf8.name"}` lines: only sent to clients that ask for them
            scan.malformed_lines += 1
            first_bad = first_bad or number
            continue
        end = match.end()
        name = line[:end]
        if name in wanted:
            laid_out = False
            ok = _read_sample(line, end, name, scan, seen)
        else:  # cheap check only (a name, then labels or a space); values are checked if nothing was wanted
            ok = end < len(line) and line[end] in "{ \t"
        if ok:
            sample_lines += 1
            if line is raw and known is None:
                _remember(heads, raw, wanted)
        else:
            scan.malformed_lines += 1
            first_bad = first_bad or number
    scan.sample_lines = sample_lines
    if laid_out:
        scan.layout = tuple(layout)
    else:
        values.clear()
    if not scan.samples and not _any_sample(lines):
        if scan.malformed_lines == 0 and scan.sample_lines == 0:
            raise PageError("no samples", "the page holds only comments (HELP/TYPE without values)")
        raise PageError("not Prometheus text", f"no line reads as a sample (first bad line {first_bad or 1})")
    if scan.malformed_lines:
        scan.problems.append(f"{scan.malformed_lines} malformed line(s) skipped (first at line {first_bad})")
    return scan


def histogram_from_samples(
    buckets: list[tuple[float, float]], count: float | None, total: float | None
) -> tuple[Histogram | None, str]:
    """A complete, consistent histogram, or None and why not.

    A page cut off mid-histogram lacks its `+Inf` bucket, `_count` or `_sum`: such a histogram is
    dropped, never read from the buckets that happen to be there.
    """
    if count is None or total is None:
        return None, "incomplete (no _count or _sum: page cut off?)"
    ordered = sorted(buckets)
    if not ordered or ordered[-1][0] != math.inf:
        return None, "incomplete (no +Inf bucket: page cut off?)"
    counts = [c for _, c in ordered]
    edges = [le for le, _ in ordered]
    if any(not math.isfinite(c) or c < 0 for c in counts) or not math.isfinite(count) or not math.isfinite(total):
        return None, "holds NaN, Inf or negative counts"
    if any(a == b for a, b in itertools.pairwise(edges)) or any(math.isnan(le) for le in edges):
        return None, "repeats a bucket edge"
    if any(later < earlier for earlier, later in itertools.pairwise(counts)):
        return None, "buckets are not cumulative"
    if counts[-1] != count:
        return None, f"+Inf bucket {counts[-1]:g} differs from _count {count:g}"
    return Histogram(buckets=tuple(ordered), count=count, sum=total), ""


# --- past the size cap: the wanted families only ----------------------------------------------------

_NAME_BYTES = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_FAMILY_COMMENT = re.compile(rb"#[ \t]+(?:HELP|TYPE|UNIT)[ \t]+([a-zA-Z_:][a-zA-Z0-9_:]*)")
_AFTER_NAME = frozenset(b"{ \t")
MAX_FAMILY_COMMENT_HEAD = 512  # `# HELP ` and a name: no real name comes near it


class WantedLines:
    """A page's sample lines of the `wanted` names, kept as the page streams in, the rest dropped unread.

    What a page grows by is series of families the daemon does not read (vLLM's `vllm:lora_requests_info`
    gains one for every ordering of adapter names and never loses one: docs/engines.md, "LoRA"). Past
    the fetch's size cap (fetch.HttpFetcher) the page goes through here: only the kept lines and the
    lines that belong to no family (comments other than HELP/TYPE/UNIT, blank or malformed lines:
    what an endless stream of junk is made of) count against `limit`. A sample line of another family,
    or its HELP/TYPE/UNIT line, costs a look at its name and is dropped, however long; its bytes are
    tallied per family (`skipped`) to say which family made the page large. Once the counted bytes
    pass `limit`, `over` is set and nothing more is taken: the lines kept so far are the families that
    came before the cut. Bytes, not text: names are ASCII, and the page is decoded once, kept lines only.
    """

    def __init__(self, wanted: frozenset[str], limit: int) -> None:
        self._wanted = frozenset(name.encode("ascii") for name in wanted)
        self._limit = limit
        self._kept: list[bytes] = []
        self.counted = 0  # bytes kept plus bytes of lines that belong to no family
        self.over = False
        self.skipped: dict[str, int] = {}  # bytes dropped per family name
        self._partial = b""  # the start of a line whose verdict needs more of it
        self._dropping: str | None = None  # the rest of a line being dropped: its family, or "" for junk

    @property
    def kept_any(self) -> bool:
        return bool(self._kept)

    def text(self) -> bytes:
        """The kept lines, each with its newline."""
        return b"".join(self._kept)

    def largest_skipped(self) -> str | None:
        others = {name: size for name, size in self.skipped.items() if name.encode("ascii") not in self._wanted}
        return max(others, key=lambda name: others[name]) if others else None

    def feed(self, data: bytes) -> bool:
        """Takes the next piece of the page; False once `over` (stop reading)."""
        if self.over:
            return False
        if self._dropping is not None:
            end = data.find(b"\n")
            self._drop(self._dropping, len(data) if end < 0 else end + 1)
            if end < 0 or self.over:
                return not self.over
            self._dropping = None
            data = data[end + 1:]
        if self._partial:
            data, self._partial = self._partial + data, b""
        end = data.rfind(b"\n")
        if end >= 0:
            lines = data[:end].split(b"\n")
            data = data[end + 1:]
            for line in lines:
                self._judge(line)
                if self.over:
                    return False
        if data:
            self._judge_start(data)
        return not self.over

    def _judge(self, line: bytes) -> None:
        """One whole line (its newline taken off): kept, dropped for its family, or counted as junk."""
        family = self._family(line, whole=True)
        if family is None:
            self._count(len(line) + 1)
            if not self.over:
                self._kept.append(line + b"\n")
        else:
            self._drop(family, len(line) + 1)

    def _judge_start(self, start: bytes) -> None:
        """The start of a line whose newline has not come yet: dropped from here if its verdict is known."""
        family = self._family(start, whole=False)
        if family is None:  # wanted, or not known yet: held (and counted) until its end
            if self.counted + len(start) > self._limit:
                self.over = True
            else:
                self._partial = start
        else:
            self._dropping = family
            self._drop(family, len(start))

    def _family(self, line: bytes, *, whole: bool) -> str | None:
        """None for a line to keep (or, not `whole`, not decided yet); else the family it is dropped
        for: its name, or "" for a line of no family (junk, counted)."""
        text = line.lstrip(b" \t") if line[:1] in (b" ", b"\t") else line
        if not text:
            return "" if whole else None
        if text[:1] == b"#":
            comment = _FAMILY_COMMENT.match(text)
            if comment is not None and (comment.end() < len(text) or whole):
                return comment.group(1).decode("ascii")
            # A start that may still become `# HELP name ...` is held; past MAX_FAMILY_COMMENT_HEAD bytes
            # without a whole name it never will.
            return "" if whole or len(text) > MAX_FAMILY_COMMENT_HEAD else None
        match = _NAME_BYTES.match(text)
        if match is None:
            return ""
        end = match.end()
        if end == len(text):
            return "" if whole else None
        if text[end] not in _AFTER_NAME:
            return ""
        name = match.group()
        return None if name in self._wanted else name.decode("ascii")

    def _drop(self, family: str, size: int) -> None:
        if family:
            self.skipped[family] = self.skipped.get(family, 0) + size
        else:
            self._count(size)

    def _count(self, size: int) -> None:
        self.counted += size
        if self.counted > self._limit:
            self.over = True
