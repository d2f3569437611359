"""Credentials out of every URL the daemon shows: log lines, the `target` label, alerts, error messages.

What counts as a credential in a URL:
  - its userinfo, `scheme://user:password@host` (the whole of it: a bare `token@host` is as secret);
  - the value of a query parameter whose name looks like one: it holds token, key, secret, password
    (passwd, pwd, pass), sig (signature), auth, credential, session, cookie, jwt or bearer, in any
    case, as a whole name or a part of one (`access_token`, `X-Amz-Signature`, `apikey`, `sig` of an
    Azure SAS). Over-redacting a harmless parameter (`monkey=1`) costs a less readable label; missing
    a secret leaks it, so the match is wide.

`redact` works on free text too (an exception's message holds a URL's path and query without its
scheme, as urllib3 and requests word them: `Max retries exceeded with url: /metrics?token=...`), so it
is applied to whole reasons and log values, not only to strings known to be URLs. The daemon refuses
URLs with userinfo at config load (exporter/config_validators.url): credentials come from files or
the environment; redaction is what keeps a query token, and anything that slips past, out of sight.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from typing import Any

REDACTED = "<redacted>"

_CREDENTIAL_NAME = re.compile(
    r"token|key|secret|passw|pwd|pass|sig|auth|credential|session|cookie|jwt|bearer", re.IGNORECASE)
# `?name=value` or `&name=value` (`;` too, as some servers split on it), anywhere in a text.
_PARAMETER = re.compile(r"([?&;])([^=&;#\s'\"<>?]+)=([^&;#\s'\"<>]*)")
# `scheme://userinfo@`: everything between `//` and the last `@` before the path, query or fragment.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s'\"<>]*)@")
# `user:password@host` without a scheme (a URL's netloc, as a `target` label is made of), at the start of
# the text or after a space, quote, bracket, `=` or `,`.
_BARE_USERINFO = re.compile(r"(^|[\s'\"(\[=,])[^\s/?#@'\"()\[\]=,]+@(?=[A-Za-z0-9\[])")


def credential_parameter(name: str) -> bool:
    """Whether a query parameter of this name is taken for a credential (its value is redacted)."""
    return _CREDENTIAL_NAME.search(name) is not None


def _parameter(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if not value or not credential_parameter(name):
        return match.group(0)
    return f"{separator}{name}={REDACTED}"


def redact(text: str) -> str:
    """`text` with every URL's userinfo and every credential-looking query value replaced by REDACTED."""
    if "@" not in text and "=" not in text:
        return text  # the common case (a label like `10.0.0.5:8000`, a reason like `HTTP 500`): no work
    if "@" in text:
        text = _USERINFO.sub(lambda match: f"{match.group(1)}{REDACTED}@", text)
        text = _BARE_USERINFO.sub(lambda match: f"{match.group(1)}{REDACTED}@", text)
    return _PARAMETER.sub(_parameter, text) if "=" in text else text


def has_userinfo(url: str) -> bool:
    """Whether a URL carries `user[:password]@` before its host: an `@` anywhere between `//` and the
    query (a password holding a raw `/` would otherwise pass as a path; an `@` meant for a path is
    written %40)."""
    _, slashes, rest = url.partition("//")
    return bool(slashes) and "@" in rest.split("?", 1)[0].split("#", 1)[0]


def redact_value(value: Any) -> Any:
    """A log value with `redact` applied to every string in it (lists, tuples and mappings walked)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {key: redact_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(item) for item in value)
    return value


def redact_event(logger: Any, method_name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: every value of the event redacted, the rendered traceback included
    (put it after `format_exc_info`). The backstop behind the sources, which redact what they log."""
    return {key: redact_value(value) for key, value in event.items()}
