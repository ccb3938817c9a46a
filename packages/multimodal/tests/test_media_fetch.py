"""fetch_media_bytes against a real HTTP server on 127.0.0.1 (threads): policy on every hop.

A "public" host is simulated without leaving the machine: the resolver is
patched to answer a public address for `public.test`, and connections to that
address are sent to the local server. Everything after the resolver (address
check, pinned connect, Host header, redirects) runs for real.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from paged.multimodal.media import MediaConnector, MediaError
from paged.multimodal.media_fetch import fetch_media_bytes
from paged.multimodal.media_url_policy import (
    MediaUrlPolicy,
    MediaUrlRefused,
    parse_allowed_media_domains,
)

BODY = b"image-bytes"
PUBLIC_IP = "93.184.216.34"  # stands for a public server; never contacted


@dataclass
class _Site:
    port: int
    seen: list[tuple[str, str]] = field(default_factory=list)  # (path, Host header)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _handler(site: _Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            site.seen.append((self.path, self.headers.get("Host", "")))
            path, _, query = self.path.partition("?")
            if path == "/ok":
                self._reply(200, BODY)
            elif path == "/redirect":  # /redirect?to=<absolute or relative URL>
                self._reply(302, b"", location=urllib.parse.parse_qs(query)["to"][0])
            elif path == "/loop":
                self._reply(302, b"", location="/loop")
            else:
                self._reply(404, b"")

        def _reply(self, code: int, body: bytes, location: str | None = None) -> None:
            self.send_response(code)
            if location is not None:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

    return Handler


@pytest.fixture
def site() -> Iterator[_Site]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(_Site(0)))
    site = _Site(server.server_address[1])
    server.RequestHandlerClass = _handler(site)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield site
    server.shutdown()
    server.server_close()


@pytest.fixture
def public_host(monkeypatch: pytest.MonkeyPatch, site: _Site) -> list[str]:
    """`public.test` resolves (once per lookup, logged) to PUBLIC_IP, served by `site`."""
    lookups: list[str] = []
    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.create_connection

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "public.test":
            lookups.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC_IP, port))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    def create_connection(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        if address[0] == PUBLIC_IP:
            address = ("127.0.0.1", address[1])
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return lookups


def _fetch(url: str, policy: MediaUrlPolicy) -> bytes:
    return fetch_media_bytes(url, policy, max_bytes=1 << 20, timeout_s=5.0)


EXPOSED = MediaUrlPolicy.for_bind_host("0.0.0.0")
LOOPBACK_BOUND = MediaUrlPolicy.for_bind_host("127.0.0.1")


def test_loopback_bound_server_fetches_loopback_urls_as_vllm_does(site: _Site) -> None:
    assert _fetch(f"{site.base}/ok", LOOPBACK_BOUND) == BODY
    # ...and follows a redirect to another loopback name.
    to = f"http://localhost:{site.port}/ok"
    assert _fetch(f"{site.base}/redirect?to={to}", LOOPBACK_BOUND) == BODY


def test_exposed_server_refuses_a_loopback_url_without_connecting(site: _Site) -> None:
    with pytest.raises(
        MediaUrlRefused, match=r"'127\.0\.0\.1' resolves to 127\.0\.0\.1, a loopback"
    ):
        _fetch(f"{site.base}/ok", EXPOSED)
    # A name is judged by what it resolves to (localhost: 127.0.0.1 and/or ::1).
    with pytest.raises(MediaUrlRefused, match=r"'localhost' resolves to .*a loopback address"):
        _fetch(f"http://localhost:{site.port}/ok", EXPOSED)
    assert site.seen == []


def test_domain_list_allows_a_listed_host_even_on_an_internal_address(site: _Site) -> None:
    policy = MediaUrlPolicy.for_bind_host("0.0.0.0", ["127.0.0.1"])
    assert _fetch(f"{site.base}/ok", policy) == BODY


def test_domain_list_refuses_other_hosts_before_connecting(site: _Site) -> None:
    for bind in ("127.0.0.1", "0.0.0.0"):
        policy = MediaUrlPolicy.for_bind_host(bind, ["images.example.com"])
        with pytest.raises(
            MediaUrlRefused,
            match=r"allowed domains: \['images\.example\.com'\]\. Input URL domain: 127\.0\.0\.1",
        ):
            _fetch(f"{site.base}/ok", policy)
    assert site.seen == []


def test_redirect_from_a_public_host_to_a_private_address_is_refused(
    site: _Site, public_host: list[str]
) -> None:
    # The public host itself is fine for an exposed server...
    assert _fetch(f"http://public.test:{site.port}/ok", EXPOSED) == BODY
    site.seen.clear()
    # ...but its redirect into the loopback network is not followed.
    to = f"http://127.0.0.1:{site.port}/ok"
    with pytest.raises(MediaUrlRefused, match=r"resolves to 127\.0\.0\.1, a loopback"):
        _fetch(f"http://public.test:{site.port}/redirect?to={to}", EXPOSED)
    assert [path for path, _ in site.seen] == [f"/redirect?to={to}"]


def test_redirect_to_an_unlisted_domain_is_refused(site: _Site) -> None:
    # vLLM 0.33.0 checks the first URL only; every hop is checked here.
    policy = MediaUrlPolicy(parse_allowed_media_domains(["127.0.0.1"]))
    to = f"http://localhost:{site.port}/ok"
    with pytest.raises(MediaUrlRefused, match="Input URL domain: localhost"):
        _fetch(f"{site.base}/redirect?to={to}", policy)
    assert len(site.seen) == 1


def test_connects_to_the_address_it_checked_and_sends_the_name(
    site: _Site, public_host: list[str]
) -> None:
    # One lookup per hop: a resolver answering differently later (DNS rebinding)
    # is never asked again. The Host header still carries the name and port.
    assert _fetch(f"http://public.test:{site.port}/redirect?to=/ok", EXPOSED) == BODY
    assert public_host == ["public.test", "public.test"]  # two hops, one lookup each
    assert site.seen[-1] == ("/ok", f"public.test:{site.port}")


def test_redirect_cap_switch_and_schemes(site: _Site) -> None:
    with pytest.raises(MediaError, match="more than 10 redirects"):
        _fetch(f"{site.base}/loop", LOOPBACK_BOUND)
    assert len(site.seen) == 11
    no_redirects = MediaUrlPolicy(allow_redirects=False)
    with pytest.raises(MediaError, match="VLLM_MEDIA_URL_ALLOW_REDIRECTS=0"):
        _fetch(f"{site.base}/redirect?to=/ok", no_redirects)
    with pytest.raises(MediaError, match="must be http"):
        _fetch(f"{site.base}/redirect?to=file:///etc/passwd", LOOPBACK_BOUND)
    with pytest.raises(MediaError, match="HTTP 404"):
        _fetch(f"{site.base}/missing", LOOPBACK_BOUND)


def test_media_connector_applies_its_policy(site: _Site) -> None:
    with pytest.raises(MediaUrlRefused, match="loopback"):
        MediaConnector(url_policy=EXPOSED).load_image(f"{site.base}/ok")
    assert site.seen == []
    # A refusal is a MediaError, hence a ValueError: the API answers 400.
    assert issubclass(MediaUrlRefused, MediaError) and issubclass(MediaError, ValueError)


def _self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a cert")
def test_https_verifies_the_hostname_while_connecting_to_the_checked_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: _Site, public_host: list[str]
) -> None:
    # A TLS server on 127.0.0.1 with a certificate for public.test, trusted through
    # SSL_CERT_FILE: the fetch succeeds only if SNI and verification use the name,
    # not the address connected to.
    cert, key = _self_signed(tmp_path, "public.test")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert _fetch(f"https://public.test:{port}/ok", EXPOSED) == BODY
        assert site.seen[-1] == ("/ok", f"public.test:{port}")
        # Another trusted certificate, for a different name: refused by verification.
        other, _ = _self_signed(tmp_path, "other.test")
        monkeypatch.setenv("SSL_CERT_FILE", str(other))
        with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED"):
            _fetch(f"https://public.test:{port}/ok", EXPOSED)
    finally:
        server.shutdown()
        server.server_close()
