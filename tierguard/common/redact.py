"""Secrets out of URLs before they reach a log line, an error message, /health or a metric label.

A Redis URL carries its password (`redis://:PASSWORD@host:6379/0`, ACL
`redis://USER:PASSWORD@host`), and redis-py also reads `password=` and `ssl_password=` from
the query; an upstream URL may carry HTTP basic credentials. Everything the product prints
about such a URL goes through `redact_url` (one URL) or `redact_text` (a message that may
quote one, such as a client library's exception). The user name stays: it tells an operator
which ACL user failed, and is not a secret.
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://[user]:password@  ->  scheme://[user]:***@  (anywhere in a text; the last @ of the
# authority ends the password, as URL parsers read it)
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s/?#@:'\"]*):(?P<secret>[^\s/?#'\"]*)@")
# password=..., ssl_password=... in a query string or a message
_QUERY_SECRET = re.compile(r"(?P<head>(?:^|[?&;\s])[a-z_]*password=)(?P<secret>[^&#\s'\"]*)", re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` with any password (in the authority or the query) replaced by `***`."""
    if url is None:
        return ""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return redact_text(text)
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:{MASK}@{host}"
    return scheme + sep + netloc + _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, tail)


def redact_text(text: str | None) -> str:
    """Every `scheme://user:password@` and `password=` value in `text` masked."""
    if not text:
        return text or ""
    out = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", str(text))
    return _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, out)
