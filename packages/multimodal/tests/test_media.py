"""Media loading: data: URLs, file:// under the allowed path, http(s) with limits, decode limits."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from paged.multimodal.hasher import MultiModalHasher
from paged.multimodal.media import MediaConnector, MediaError, MediaLimits, decode_image


def png_bytes(seed: int = 0, size: tuple[int, int] = (20, 12)) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/ok.png":
            self._send(png_bytes(), "image/png")
        elif self.path == "/slow.png":
            time.sleep(3)
            self._send(png_bytes(), "image/png")
        elif self.path == "/trickle.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(40):  # never stalls a single read long, yet never finishes in time
                try:
                    self.wfile.write(b"\0" * 10)
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)
        elif self.path == "/big.png":
            self._send(b"\0" * 5000, "image/png")
        elif self.path == "/page.html":
            self._send(b"<html></html>", "text/html")
        else:
            self.send_error(404)

    def _send(self, body: bytes, media_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_data_url_file_and_http_give_the_same_picture_and_hash(
    tmp_path: Path, http_base: str
) -> None:
    raw = png_bytes()
    (tmp_path / "a.png").write_bytes(raw)
    conn = MediaConnector(allowed_local_media_path=tmp_path)
    images = [
        conn.load_image(data_url(raw)),
        conn.load_image((tmp_path / "a.png").as_uri()),
        conn.load_image(f"{http_base}/ok.png"),
        decode_image(raw, MediaLimits()),
    ]
    hashes = {MultiModalHasher.hash_kwargs(image=im) for im in images}
    assert len(hashes) == 1
    assert images[0].size == (20, 12)


def test_file_urls_need_the_allowed_path_and_stay_inside_it(tmp_path: Path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes(1))
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        MediaConnector().load_image((inside / "a.png").as_uri())
    conn = MediaConnector(allowed_local_media_path=inside)
    assert conn.load_image((inside / "a.png").as_uri()).size == (20, 12)
    with pytest.raises(MediaError, match="outside the allowed local media path"):
        conn.load_image(f"file://{inside}/../secret.png")
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(MediaError, match="outside"):
        conn.load_image((inside / "link.png").as_uri())
    with pytest.raises(MediaError, match="cannot read"):
        conn.load_image((inside / "missing.png").as_uri())
    with pytest.raises(ValueError, match="not an existing directory"):
        MediaConnector(allowed_local_media_path=tmp_path / "nope")


def test_http_time_and_size_limits(http_base: str) -> None:
    conn = MediaConnector(MediaLimits(fetch_timeout_s=1.0, max_image_bytes=1000))
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        conn.load_image(f"{http_base}/slow.png")
    with pytest.raises(MediaError, match="timed out"):
        conn.load_image(f"{http_base}/trickle.png")
    assert time.monotonic() - t0 < 4.5  # each bounded near 1 s, not 3-4 s
    with pytest.raises(MediaError, match="more than the limit of 1000 bytes"):
        conn.load_image(f"{http_base}/big.png")
    with pytest.raises(MediaError, match="unsupported media type 'text/html'"):
        conn.load_image(f"{http_base}/page.html")
    with pytest.raises(MediaError, match="HTTP 404"):
        conn.load_image(f"{http_base}/missing.png")
    with pytest.raises(MediaError, match="disabled"):
        MediaConnector(allow_http=False).load_image(f"{http_base}/ok.png")


def test_bad_data_urls_and_schemes() -> None:
    conn = MediaConnector()
    with pytest.raises(MediaError, match="unsupported media type 'text/plain'"):
        conn.load_image(data_url(b"hello", "text/plain"))
    with pytest.raises(MediaError, match="cannot decode image"):
        conn.load_image(data_url(b"definitely not an image"))
    with pytest.raises(MediaError, match="not valid base64"):
        conn.load_image("data:image/png;base64,@@@@")
    with pytest.raises(MediaError, match="base64-encoded"):
        conn.load_image("data:image/png,abc")
    with pytest.raises(MediaError, match="scheme 'ftp'"):
        conn.load_image("ftp://example.com/a.png")
    with pytest.raises(MediaError, match="non-empty"):
        conn.load_image("")


def test_decompression_bomb_refused_from_its_header() -> None:
    # A 1-bit 20000x20000 PNG compresses to a few KB but claims 400M pixels.
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    bomb = buf.getvalue()
    assert len(bomb) < 200_000
    with pytest.raises(MediaError, match="pixels, more than the limit"):
        decode_image(bomb, MediaLimits())
    # Under PIL's own threshold, ours still applies before any pixel is decoded.
    small = io.BytesIO()
    Image.new("1", (3000, 3000)).save(small, format="PNG")
    with pytest.raises(MediaError, match="3000x3000 = 9000000 pixels, more than the limit"):
        decode_image(small.getvalue(), MediaLimits(max_image_pixels=1_000_000))
    with pytest.raises(MediaError, match="bytes, more than the limit of 100 bytes"):
        decode_image(png_bytes(), MediaLimits(max_image_bytes=100))
    with pytest.raises(MediaError, match="more than the limit of 100 bytes"):
        MediaConnector(MediaLimits(max_image_bytes=100)).load_image(data_url(png_bytes()))
    with pytest.raises(ValueError, match="max_image_pixels"):
        MediaLimits(max_image_pixels=0)
