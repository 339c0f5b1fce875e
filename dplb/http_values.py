"""The checks of values an operator configures for the router's HTTP surface: API keys and CORS origins.

Contract
- :func:`check_bearer_token`: an API key is an HTTP bearer token (RFC 6750 §2.1, ``b64token``,
  :data:`BEARER_TOKEN`): the one check of ``--api-key`` (:class:`dplb.config.RouterConfig`) and of ``dplb tenants
  hash-key`` (a key the router refuses, or that no client can send in a header, gets no digest either).
- :func:`check_origins`: each CORS origin is ``*`` or an origin as a browser serialises it in its ``Origin``
  header (RFC 6454 §6.1: ``scheme://host[:port]``, lower case, no path, no trailing ``/``), the host optionally
  starting with ``*.`` (the router's CORS layer, Litestar's ``CORSConfig``, matches ``*`` as a wildcard).
- Both raise :class:`~dplb.errors.ConfigError` with one line naming the flag; a key is never quoted in it (only its
  length and what is wrong at which position).
"""

from __future__ import annotations

import re

from dplb.errors import ConfigError

#: An HTTP bearer token (RFC 6750 §2.1, ``b64token``): what an API key may be. It travels in a header and in
#: systemd's router.env, so neither a newline (a header or an env line injected) nor a quote may be in it.
BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
_TOKEN_PREFIX = re.compile(r"[A-Za-z0-9._~+/-]*=*")
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
#: A serialised origin (RFC 6454 §6.1): scheme, host (a DNS name, optionally ``*.``-prefixed, an IPv4 address or a
#: bracketed IPv6 one), optional port; what a browser's ``Origin`` header carries, so nothing else can match one.
ORIGIN = re.compile(rf"[a-z][a-z0-9+.-]*://(?:(?:\*\.)?{_LABEL}(?:\.{_LABEL})*|\[[0-9a-f:.]+\])"
                    r"(?::(?P<port>\d{1,5}))?")


def check_bearer_token(key: str, what: str) -> None:
    """Refuse an API key that is not a :data:`BEARER_TOKEN`; ``what`` names the flag or input. The message gives
    the key's length and what is wrong where (:func:`_token_problem`), never the key. Raises :class:`ConfigError`."""
    if not BEARER_TOKEN.fullmatch(key):
        raise ConfigError(f"{what} must be a bearer token: letters, digits and -._~+/, then optional '=' padding (RFC "
                          f"6750 §2.1); no spaces, quotes or control characters (the key given, {len(key)} "
                          f"character{'' if len(key) == 1 else 's'}, {_token_problem(key)})")


def _token_problem(key: str) -> str:
    """Why ``key`` is no :data:`BEARER_TOKEN`, without quoting it: ``has a space at position 1``, ``is empty``."""
    m = _TOKEN_PREFIX.match(key)
    i = m.end() if m else 0
    if i == len(key):
        return "is empty" if not key else "is only '=' padding"
    c = key[i]
    kind = ("a space" if c == " " else "a control character" if ord(c) < 32 or ord(c) == 127 else
            "a non-ASCII character" if ord(c) > 127 else "a character after the '=' padding" if key[i - 1] == "="
            else "a character outside that alphabet")
    return f"has {kind} at position {i + 1}"


#: The ports a browser leaves out of a serialised origin (RFC 6454 §6.2: the default port of the scheme is omitted):
#: ``https://a.example:443`` is never what it sends, so it would never match.
DEFAULT_PORTS: dict[str, int] = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_origin(text: str) -> bool:
    """True for ``*`` or a serialised origin (:data:`ORIGIN`) whose port, if any, is 1..65535 and not its scheme's
    default (:data:`DEFAULT_PORTS`)."""
    if text == "*":
        return True
    m = ORIGIN.fullmatch(text)
    if m is None or m["port"] is None:
        return m is not None
    port = int(m["port"])
    return 1 <= port <= 65535 and DEFAULT_PORTS.get(text.split(":", 1)[0]) != port


def check_origins(origins: tuple[str, ...], flag: str) -> None:
    """Refuse any item of ``origins`` that is not :func:`is_origin` (a browser would never send it, so CORS would
    silently stay off for the origin meant). Raises :class:`ConfigError` naming ``flag`` and every bad item."""
    bad = [o for o in origins if not is_origin(o)]
    if bad:
        verb = "is not an origin" if len(bad) == 1 else "are not origins"
        raise ConfigError(f"{flag}: {', '.join(map(repr, bad))} {verb}: an origin is SCHEME://HOST[:PORT] as a "
                          "browser sends it (lower case, no path or trailing '/', no default port such as :443 for "
                          "https; HOST may start with '*.'), e.g. "
                          "https://app.example.com, or * for any")


__all__ = ["BEARER_TOKEN", "DEFAULT_PORTS", "ORIGIN", "check_bearer_token", "check_origins", "is_origin"]
