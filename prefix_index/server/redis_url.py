"""The index's Redis URL: checked before anything starts, and shown in logs without its secrets.

redis-py takes a password in two places of a URL: the user info (`redis://user:PASSWORD@host`)
and any query argument, passed as is to the connection (`?password=...`, `?ssl_password=...`).
Neither may reach a log, an error message or a traceback: the URL is never shown unredacted,
and the reasons a URL is refused never quote its parts (a '#' or '/' left unescaped in a
password moves the rest of it into the port or the path, which parser errors quote).
"""

from __future__ import annotations

from urllib.parse import unquote_plus, urlsplit, urlunsplit

from redis.asyncio.connection import parse_url

SCHEMES = ("redis", "rediss", "unix")
# The index reads its URL from this variable when no --redis-url is given: a password in it is
# out of `ps`, which shows every user each command line.
REDIS_URL_ENV = "PAGEDGEN_REDIS_URL"
EXPECTED = ("redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or "
            "unix://[[user]:password@]/path.sock[?db=N]; percent-encode '@', ':', '/', '#' "
            "and '?' in a password")


def redacted_url(url: str) -> str:
    """The URL with every password in it replaced by '***' (for logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed '[': show nothing of it
        return "(an unparseable URL, not shown)"
    if parts.fragment or "@" in url[url.find("//") + 2 + len(parts.netloc):]:
        # An unescaped '#' or '/' in a password splits it across the URL's parts.
        return f"{parts.scheme}://(a URL not shown: it may hold a password)"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    pairs = []
    for pair in parts.query.split("&") if parts.query else []:
        name, eq, _value = pair.partition("=")
        secret = "password" in unquote_plus(name).lower()
        pairs.append(f"{name}=***" if secret and eq else pair)
    query = "&".join(pairs)
    if netloc == parts.netloc and query == parts.query:
        return url
    shown = urlunsplit(parts._replace(netloc=netloc, query=query))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # (urlunsplit drops the '//')
        shown = f"{parts.scheme}://{shown[len(parts.scheme) + 1:]}"
    return shown


def url_problem(url: str) -> str | None:
    """Why redis-py cannot use `url` as meant (in words that quote none of it but the
    scheme), or None. A database path that is not a number is refused here: redis-py would
    silently use database 0."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "it is not a URL (an unbalanced '[' in the host?)"
    if parts.scheme not in SCHEMES:
        return f"its scheme {parts.scheme!r} is not one of {', '.join(SCHEMES)}"
    if parts.fragment:
        return "it has a '#' (unescaped in the password?)"
    if parts.scheme != "unix":
        if not parts.hostname and "@" in parts.netloc:  # (no host at all: redis-py's localhost)
            return "its host is empty (an unescaped '/' or '@' in the password?)"
        if not parts.hostname and "@" in url[len(parts.scheme) + 3:]:
            return "its host is empty (an unescaped '/' in the password?)"
        try:
            _ = parts.port
        except ValueError:
            return ("its port is not a number in 0..65535 (an unescaped ':' or '/' in the "
                    "password?)")
        db = unquote_plus(parts.path).strip("/")
        if db and not (db.isascii() and db.isdigit()):  # ('²' is a digit to Python)
            return "its path is not a database number (/0, /1, ...)"
    try:
        parse_url(url)
    except ValueError as error:
        text = str(error)
        # "Invalid value for 'NAME' in connection URL.": names the argument, not its value.
        return text if text.startswith("Invalid value for ") else "redis-py cannot parse it"
    return None
