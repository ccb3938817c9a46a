"""GET an http(s) media URL under a `MediaUrlPolicy`, a byte limit and one deadline.

Each hop (the URL, then every redirect target):

    check_host(hostname)                   allow-list, before any network traffic
    getaddrinfo(hostname) once             -> candidate addresses
    check_address(hostname, ip) per ip     refused ones are never connected to
    connect to that ip                     Host header and TLS SNI/certificate name
                                           stay the hostname, so virtual hosts and
                                           HTTPS verification work as usual
    3xx + Location                         next hop (at most `max_redirects`)

Connecting to the address that was checked, instead of handing the hostname to
a client library that resolves it again, is what closes the DNS-rebinding gap
(a name answering 203.0.113.7 to the check and 127.0.0.1 to the connect).
Environment proxies (HTTP_PROXY) are not used: through a proxy the address
check would judge the proxy, not the target. Blocking: call it off the event loop.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from paged.multimodal.media_errors import MediaError
from paged.multimodal.media_url_policy import (
    IPAddress,
    MediaUrlPolicy,
    MediaUrlRefused,
    normalize_host,
)

_READ_CHUNK = 64 * 1024
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str  # as in the URL (no brackets), for Host, SNI and the policy
    port: int
    path: str  # path + query, what goes on the request line


def _parse_target(url: str) -> _Target:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise MediaError(f"media URL {url} must be http(s), not {scheme or 'schemeless'!r}")
    host = normalize_host(parts.hostname or "")
    if not host:
        raise MediaError(f"media URL {url} has no host")
    if not host.isascii():
        raise MediaError(f"media URL {url} has an invalid international hostname")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as e:
        raise MediaError(f"media URL {url} has a bad port: {e}") from e
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return _Target(scheme, host, port, path)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to one already-checked address; `host` still names the Host header."""

    def __init__(self, host: str, port: int, ip: IPAddress, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((str(self._ip), self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to one already-checked address; SNI and certificate checks use `host`."""

    def __init__(
        self, host: str, port: int, ip: IPAddress, timeout: float, context: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._ip = ip
        self._tls = context

    def connect(self) -> None:
        raw = socket.create_connection((str(self._ip), self.port), self.timeout)
        try:
            self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise


def _resolve(url: str, target: _Target) -> list[IPAddress]:
    """Every address of the target's host, in the resolver's order (literals as is)."""
    try:
        return [ipaddress.ip_address(target.host.split("%", 1)[0])]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise MediaError(f"fetching {url} failed: cannot resolve {target.host!r}: {e}") from e
    seen: dict[IPAddress, None] = {}
    for info in infos:
        seen.setdefault(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
    return list(seen)


class _Deadline:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def error(self) -> MediaError:
        return MediaError(f"timed out fetching {self.url} after {self.timeout_s:g} s")


def _connect(
    url: str, target: _Target, policy: MediaUrlPolicy, deadline: _Deadline
) -> http.client.HTTPConnection:
    """A connection to the first permitted address that accepts; refused ones are skipped."""
    refused: MediaUrlRefused | None = None
    failure: OSError | None = None
    for ip in _resolve(url, target):
        try:
            policy.check_address(target.host, ip)
        except MediaUrlRefused as e:
            refused = refused or e
            continue
        conn: http.client.HTTPConnection
        if target.scheme == "https":
            context = ssl.create_default_context()
            conn = _PinnedHTTPSConnection(
                target.host, target.port, ip, deadline.remaining(), context
            )
        else:
            conn = _PinnedHTTPConnection(target.host, target.port, ip, deadline.remaining())
        try:
            conn.connect()
            return conn
        except TimeoutError:
            conn.close()
            raise deadline.error() from None
        except OSError as e:
            conn.close()
            failure = e
    if failure is not None:
        raise MediaError(f"fetching {url} failed: {failure}") from failure
    if refused is not None:
        raise refused
    raise MediaError(f"fetching {url} failed: {target.host!r} has no address")


def _read_body(
    url: str,
    sock: socket.socket,
    response: http.client.HTTPResponse,
    max_bytes: int,
    deadline: _Deadline,
) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(
            f"image at {url} is {declared} bytes, more than the limit of {max_bytes} bytes"
        )
    chunks: list[bytes] = []
    total = 0
    while True:
        # The socket timeout bounds each read; the deadline bounds the sum
        # (a server trickling bytes must not hold a worker thread forever).
        sock.settimeout(deadline.remaining())
        chunk = response.read1(_READ_CHUNK)  # what has arrived, not a full chunk
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise MediaError(f"image at {url} is more than the limit of {max_bytes} bytes")
        chunks.append(chunk)


def fetch_media_bytes(
    url: str,
    policy: MediaUrlPolicy,
    *,
    max_bytes: int,
    timeout_s: float,
    check_content_type: Callable[[str, str], None] | None = None,
    user_agent: str = "paged",
) -> bytes:
    """The body of `url` after redirects; `MediaError` (or `MediaUrlRefused`) saying why not.

    `timeout_s` bounds the whole fetch, redirects included (DNS lookups
    excepted: the resolver has no timeout). `check_content_type(content_type,
    url)` may refuse the final response from its headers, before its body is read.
    """
    deadline = _Deadline(url, timeout_s)
    current = url
    for _hop in range(policy.max_redirects + 1):
        target = _parse_target(current)
        policy.check_host(target.host)
        conn = _connect(current, target, policy, deadline)
        response: http.client.HTTPResponse | None = None
        try:
            conn.request(
                "GET", target.path, headers={"User-Agent": user_agent, "Connection": "close"}
            )
            # Kept here: getresponse() hands a closing connection's socket to the response.
            sock = conn.sock
            response = conn.getresponse()
            if response.status in _REDIRECT_CODES:
                location = response.getheader("Location")
                if not location:
                    raise MediaError(
                        f"fetching {current} failed: HTTP {response.status} without a Location"
                    )
                if not policy.allow_redirects:
                    raise MediaError(
                        f"fetching {current} failed: HTTP {response.status} redirect to "
                        f"{location}, and redirects are off (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)"
                    )
                current = urllib.parse.urljoin(current, location)
                continue
            if not 200 <= response.status < 300:
                raise MediaError(
                    f"fetching {current} failed: HTTP {response.status} {response.reason}"
                )
            if check_content_type is not None:
                check_content_type(response.getheader("Content-Type") or "", current)
            return _read_body(current, sock, response, max_bytes, deadline)
        except TimeoutError:
            raise deadline.error() from None
        except (http.client.HTTPException, OSError) as e:
            raise MediaError(f"fetching {current} failed: {e}") from e
        finally:
            if response is not None:
                response.close()
            conn.close()
    raise MediaError(f"fetching {url} failed: more than {policy.max_redirects} redirects")
