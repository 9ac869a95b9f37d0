"""What stands between the network and the server: the Host allow-list, the API key, the size of a
request's body and the time a client may take to send its request.

- *Host allow-list* (on by default): a request whose `Host` header names none of the allowed hosts is
  refused (400). A page on another site cannot reach a loopback server through DNS rebinding, since the
  browser sends that site's name. Allowed: the loopback names, the address the server is bound to, the
  machine's own names when it listens on every interface, and what the operator adds (`*`: any).
- *Cross-site requests*: a request that may cost work (any method but GET, HEAD and OPTIONS) is refused
  when it comes from a web page on another site: 403 when its `Origin` header names another origin than
  the one it was sent to (its `Host`) and none of `allowed_origins`, and 415 unless its body is declared
  `application/json`. A browser sends a cross-site request without asking first (no CORS preflight) only
  with a form's content types and then always names the page's origin, so no page the user visits can
  make a keyless loopback server work. The allowed origins also get CORS answers (`serve.app`), so a page
  there can call the API.
- *API keys*: with any key configured, every request but the page (`/`) and `/health` must carry one as
  OpenAI's clients send it, `Authorization: Bearer KEY` (401 otherwise). A key is one word of at least
  MIN_KEY_LENGTH characters. A server bound beyond loopback refuses to start without a key
  (`check_exposure`). A key's identity (a digest, never the key) is the request's tenant, which scopes
  cross-request memory (`serve.app`). `/metrics`, every tenant's counters, answers to `metrics_key` only
  where one is given or there are several API keys (403 without one).
- *Body*: refused (413) as soon as its `Content-Length`, or what has arrived of it, passes
  `max_body_bytes`; read whole within `read_seconds` (408 otherwise) before the app sees it.
- *Head*: a connection that has not sent a whole request head within `read_seconds` of opening (or of
  sending its next request's first byte) is closed (`GuardedProtocol`, uvicorn's h11 protocol with that
  deadline added; uvicorn alone waits for ever).
- *Early answers*: a request refused before its body is read (413 from the `Content-Length`, 415, 401,
  403) ends its connection, and the answer reaches a client that sends the whole body before it reads, as
  Python's http.client does: the connection is half-closed and what the client still sends is read and
  dropped for up to `read_seconds` and LINGER_BYTES before it is closed (`GuardedProtocol`), since closing
  a socket with unread data resets the connection and the client's system drops the answer with it.

Every refusal is an OpenAI-style error body; the middleware also counts every response by endpoint and
status for `/metrics`, the unhandled 500s included.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdecode.errors import UserError
from specdecode.serve.protocol import APIError, quoted

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PUBLIC_PATHS = frozenset({"/", "/health"})  # the page asks for the key itself; health checks carry none
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # the methods that send no body and cost no generation
MIN_KEY_LENGTH = 16  # characters of an API key: `openssl rand -hex 24` gives 48
LINGER_BYTES = 64 << 20  # what is read and dropped of a refused body before its connection is closed
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_READ_SECONDS = 15.0
API_KEY_VARIABLE = "SPECDECODE_API_KEY"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def key_identity(key: str) -> str:
    """Names a key's tenant without keeping the key in it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Guard:
    api_keys: tuple[str, ...] = ()  # none: no authentication (loopback only)
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES  # "*": any Host header
    allowed_origins: tuple[str, ...] = ()  # web origins beside the server's own, as `scheme://host[:port]`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_seconds: float = DEFAULT_READ_SECONDS  # to send a request's head, and again its body
    docs: bool = False  # serve /docs and /openapi.json (behind the key, if any)
    # the one key `/metrics` answers to (its counters are every tenant's); None: any key where there is one
    # tenant, none where there are several
    metrics_key: str | None = None

    def __post_init__(self) -> None:
        for key in self.api_keys + ((self.metrics_key,) if self.metrics_key is not None else ()):
            if any(c.isspace() for c in key):
                raise UserError("an API key is one word, without spaces (give each key its own --api-key)")
            if len(key) < MIN_KEY_LENGTH:
                raise UserError(f"an API key must have at least {MIN_KEY_LENGTH} characters (one has {len(key)}); "
                                "`openssl rand -hex 24` makes one")
        # as browsers write them in `Origin` (lower case, no trailing slash), or a UserError
        object.__setattr__(self, "allowed_origins", tuple(origin_name(o) for o in self.allowed_origins))
        if self.max_body_bytes < 1024 or not self.read_seconds > 0:
            raise UserError("the body limit must be at least 1 KiB and the read timeout positive")

    @classmethod
    def for_address(cls, host: str, allowed_hosts: tuple[str, ...] = (), **options) -> Guard:
        """The rules for a server bound to `host`: the loopback names, that address (when it is one), the
        machine's names (when it is every interface) and `allowed_hosts` may be named in `Host`."""
        names = list(LOOPBACK_NAMES) + list(allowed_hosts)
        if host in ("0.0.0.0", "::", ""):
            names += [socket.gethostname(), socket.getfqdn()]
        else:
            names.append(host.strip("[]"))
        guard = cls(allowed_hosts=tuple(dict.fromkeys(n.lower().rstrip(".") for n in names if n)), **options)
        check_exposure(host, guard)
        return guard

    def host_allowed(self, header: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        if not header:
            return False
        name = header[1 : header.find("]")] if header.startswith("[") else header.rsplit(":", 1)[0]
        return name.lower().rstrip(".") in self.allowed_hosts

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """Whether a request whose `Origin` header is `origin`, sent to `host` (its `Host` header), may cost
        work: no origin (not a browser, or a browser's same-origin GET), the page's own origin (a browser
        writes the host and port in both alike, the default port left out), or an allowed one."""
        if origin is None:
            return True
        parts = urlsplit(origin.strip())
        if parts.scheme in ("http", "https") and host and parts.netloc.lower() == host.strip().lower():
            return True
        return origin.strip().lower().rstrip("/") in self.allowed_origins

    def tenant(self, authorization: str | None, keys: tuple[str, ...] | None = None) -> str | None:
        """The identity of the key a request carries (`Authorization: Bearer KEY`), or None for none of `keys`
        (default: the API keys) that matches. Every key is compared, in constant time."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        given_digest = hashlib.sha256(given.strip().encode()).digest()
        found = None
        for key in self.api_keys if keys is None else keys:
            if hmac.compare_digest(given_digest, hashlib.sha256(key.encode()).digest()):
                found = key_identity(key)
        return found


def origin_name(origin: str) -> str:
    """An origin given to allow (`scheme://host[:port]`) as browsers send it in `Origin`, or a UserError."""
    name = origin.strip().lower().rstrip("/")
    try:
        parts = urlsplit(name)
        _ = parts.port  # reading it raises a ValueError for a port out of range or not a number
    except ValueError:  # that, or an unclosed IPv6 bracket
        parts = None
    if not (parts and parts.scheme and parts.hostname and "@" not in parts.netloc
            and name == f"{parts.scheme}://{parts.netloc}"):
        raise UserError(f"an allowed origin is a scheme, a host and maybe a port, such as http://localhost:3000, "
                        f"with no path; not {origin!r}")
    return name


def check_exposure(host: str, guard: Guard) -> None:
    """A UserError for a server that would listen beyond this machine with no API key."""
    if not guard.api_keys and not is_loopback(host):
        raise UserError(f"listening on {host} exposes the server beyond this machine: give it an API key "
                        f"(--api-key KEY or ${API_KEY_VARIABLE}), which clients send as `Authorization: Bearer KEY`")


async def send_error(send, error: APIError, close: bool = False) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + [
        (name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    if close:  # the client may still be sending: end the connection after the answer
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ClientGone(Exception):
    """The client disconnected before its answer: nobody to answer (counted as status 499)."""


class GuardMiddleware:
    """The ASGI middleware applying a Guard; `on_response(endpoint, status)` counts every answer
    (endpoint: one of `endpoints`, or "other")."""

    def __init__(self, app, guard: Guard, endpoints: frozenset[str], on_response: Callable[[str, int], None]):
        self.app, self.guard, self.endpoints, self.on_response = app, guard, endpoints, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: list[int] = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        body_pending = scope["method"] not in SAFE_METHODS
        try:
            scope.setdefault("state", {})["tenant"] = self._admit(scope, headers)
            if body_pending:
                self._check_json(headers)
                body = await self._read_body(headers, receive)
                body_pending = False
                receive = _replay(body, receive)
            await self.app(scope, receive, counted)
        except APIError as error:
            if not status:  # refused before its body was read: the connection ends (`GuardedProtocol` lingers)
                await send_error(counted, error, close=body_pending)
        except ClientGone:
            pass
        except Exception:
            status.append(500)  # the app's error handler answers it (ServerErrorMiddleware, outside)
            raise
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.on_response(endpoint, status[0] if status else 499)  # 499: the client left first

    def _admit(self, scope, headers: dict[str, str]) -> str | None:
        """The request's tenant (its key's identity; None without keys), or an APIError refusing it."""
        if not self.guard.host_allowed(headers.get("host")):
            host = quoted(headers.get("host", ""))
            raise APIError(400, f"This server does not answer to the host `{host}` (allow it with "
                                f"`specdecode serve --allowed-host NAME`).", code="invalid_host")
        origin = headers.get("origin")
        if scope["method"] not in SAFE_METHODS and not self.guard.origin_allowed(origin, headers.get("host")):
            raise APIError(403, f"This server does not take requests from the web page at `{quoted(origin or '')}` "
                                "(allow its origin with `specdecode serve --allowed-origin ORIGIN`).",
                           code="invalid_origin")
        # /metrics counts every tenant's traffic: with several tenants, it answers only to its own key
        metrics = scope["path"] == "/metrics" and (self.guard.metrics_key is not None or len(self.guard.api_keys) > 1)
        if metrics and self.guard.metrics_key is None:
            raise APIError(403, "/metrics counts every tenant's requests: with several API keys it answers only to "
                                "its own key (`specdecode serve --metrics-key KEY`).", code="metrics_key_required")
        if not metrics and (not self.guard.api_keys or scope["path"] in PUBLIC_PATHS):
            return None
        authorization = headers.get("authorization")
        tenant = self.guard.tenant(authorization, (self.guard.metrics_key,) if metrics and self.guard.metrics_key
                                   else None)
        if tenant is None:
            message = ("Incorrect API key provided." if authorization else
                       "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`.")
            raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None if metrics else tenant

    @staticmethod
    def _check_json(headers: dict[str, str]) -> None:
        """A 415 for a body not declared JSON: the form types a web page may send cross-site unasked
        (`text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data`) among others."""
        declared = headers.get("content-type", "")
        if declared.partition(";")[0].strip().lower() != "application/json":
            got = f"`{quoted(declared)}`" if declared else "none"
            raise APIError(415, f"The request body must be JSON, sent with `Content-Type: application/json` "
                                f"(got {got}).", code="unsupported_media_type")

    async def _read_body(self, headers: dict[str, str], receive) -> bytes:
        limit = self.guard.max_body_bytes
        too_large = APIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                             code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large  # refused before a byte of it is read
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.guard.read_seconds
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise APIError(408, f"The request body did not arrive within {self.guard.read_seconds:g} s.",
                               code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise too_large
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that gives the body read already, then the client's later messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class _LingeringTransport:
    """A connection's transport as uvicorn's protocol sees it, but for `close()`, which the protocol decides
    (`GuardedProtocol.close_transport`): uvicorn closes as soon as its answer is sent."""

    def __init__(self, transport, protocol: GuardedProtocol):
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        self._protocol.close_transport()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol, with two changes:

    - a deadline for the request head: the connection is closed when a request head is not whole
      `head_seconds` after the connection opened, or after the first byte of a later request on it (a
      slow-loris client);
    - a lingering close: closing the connection while the client is still sending the request's body (a
      413 from the `Content-Length`, a 408) half-closes it instead, and what still arrives is dropped,
      for up to `head_seconds` and LINGER_BYTES, before the close. A client that sends its whole body
      before reading (Python's http.client) otherwise gets a reset, and its system drops the answer.
    """

    head_seconds = DEFAULT_READ_SECONDS
    _head_timer: asyncio.TimerHandle | None
    _linger_timer: asyncio.TimerHandle | None

    def connection_made(self, transport) -> None:
        self._raw, self.lingering, self._dropped, self._linger_timer = transport, False, 0, None
        # the proxy stands in for the transport (every attribute but close and is_closing is the transport's)
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the answer is sent: the rest of the body is dropped unparsed
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self._raw.close()
            return
        super().data_received(data)
        if not self._awaiting_head():
            self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_seconds, self._head_too_slow)

    def close_transport(self) -> None:
        """Close, or linger first while the client is still sending its request's body."""
        if self.lingering:
            return
        raw = self._raw
        if self.conn.their_state is h11.SEND_BODY and not raw.is_closing() and raw.can_write_eof():
            self.lingering = True
            self._stop_head_timer()
            raw.write_eof()  # after the answer: the client reads it, then the end of the connection
            raw.resume_reading()
            self._linger_timer = self.loop.call_later(self.head_seconds, raw.close)
        else:
            raw.close()

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.lingering:  # the server stops: no waiting for the client
            self._raw.close()
        super().shutdown()

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self._raw.close()  # at once: the client has had its time


def uvicorn_options(guard: Guard) -> dict:
    """uvicorn's settings beside the address (`uvicorn.run`, `uvicorn.Config`): the head deadline and the
    lingering close (`GuardedProtocol`), warnings only in the log."""
    protocol = type("GuardedProtocol", (GuardedProtocol,), {"head_seconds": guard.read_seconds})
    return {"log_level": "warning", "http": protocol}
