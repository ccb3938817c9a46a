"""Loading images of OpenAI `image_url` content parts, with limits (seed: MM処理パイプライン).

Three sources, as vLLM's `MediaConnector`:

    data:<type>;base64,<payload>   decoded in memory; <type> must be an image type
    file:///abs/path               only under `allowed_local_media_path` (off by default)
    http(s)://...                  fetched with a byte limit and a wall-clock deadline,
                                   under a `MediaUrlPolicy` (media_url_policy.py: vLLM's
                                   --allowed-media-domains, and private addresses refused
                                   by servers listening beyond loopback)

Every image is decoded by PIL under two limits checked *before* the pixels are
loaded: the encoded size (`max_image_bytes`) and the pixel count
(`max_image_pixels`, which stops decompression bombs: a tiny PNG that claims
50k x 50k pixels is refused from its header). Every failure is a `MediaError`
(a `ValueError`) whose message names the problem, so the API turns it into a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from paged.multimodal.media_errors import MediaError
from paged.multimodal.media_fetch import fetch_media_bytes
from paged.multimodal.media_url_policy import MediaUrlPolicy

# vLLM's VLLM_IMAGE_FETCH_TIMEOUT default (seconds).
DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
# PIL's own bomb threshold is ~89M pixels; 64M already exceeds any real photo
# a vision tower resizes to 896x896, and bounds decode memory at ~256 MB (RGBA).
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024

__all__ = ["MediaConnector", "MediaError", "MediaLimits", "MediaUrlPolicy", "decode_image"]


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Bounds on what one image may cost to fetch and decode."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_image_bytes <= 0:
            raise ValueError(f"max_image_bytes must be > 0, got {self.max_image_bytes}")
        if self.max_image_pixels <= 0:
            raise ValueError(f"max_image_pixels must be > 0, got {self.max_image_pixels}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, ...) under `limits`; the image is fully loaded."""
    if len(data) > limits.max_image_bytes:
        raise MediaError(
            f"image is {len(data)} bytes, more than the limit of {limits.max_image_bytes} bytes"
        )
    try:
        with warnings.catch_warnings():
            # PIL warns (then errors) on bombs by its own global threshold; ours is checked below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise MediaError(
                    f"image is {width}x{height} = {width * height} pixels, more than the "
                    f"limit of {limits.max_image_pixels} pixels"
                )
            image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"cannot decode image: {e}") from e
    except Image.DecompressionBombError as e:
        # PIL refuses from the header alone above twice its own threshold.
        raise MediaError(
            f"image rejected as a decompression bomb: it has too many pixels, more than the "
            f"limit of {limits.max_image_pixels} pixels ({e})"
        ) from e
    return image


def _check_image_media_type(media_type: str, where: str) -> None:
    # application/octet-stream: servers that do not know better; PIL decides.
    main = media_type.split(";", 1)[0].strip().lower()
    if not (main.startswith("image/") or main in ("", "application/octet-stream")):
        raise MediaError(f"unsupported media type {main!r} for an image ({where})")


class MediaConnector:
    """Turns the `url` of an `image_url` part into a decoded PIL image.

    `allowed_local_media_path` is vLLM's `--allowed-local-media-path`: None
    refuses every `file://` URL; otherwise the resolved path (symlinks
    followed) must lie inside that directory. `allow_http` lets a server turn
    http(s) fetching off; `url_policy` says which http(s) hosts and addresses
    may be fetched (default: any, as vLLM). Blocking: call it off the event loop.
    """

    def __init__(
        self,
        limits: MediaLimits | None = None,
        *,
        allowed_local_media_path: str | Path | None = None,
        allow_http: bool = True,
        url_policy: MediaUrlPolicy | None = None,
    ) -> None:
        self.limits = limits or MediaLimits()
        self.allow_http = allow_http
        self.url_policy = url_policy or MediaUrlPolicy()
        self.allowed_local_media_path: Path | None = None
        if allowed_local_media_path is not None and str(allowed_local_media_path) != "":
            root = Path(allowed_local_media_path).resolve()
            if not root.is_dir():
                raise ValueError(
                    f"allowed_local_media_path {str(allowed_local_media_path)!r} "
                    "is not an existing directory"
                )
            self.allowed_local_media_path = root

    def load_image(self, url: str) -> Image.Image:
        """Fetch and decode the image `url` names; `MediaError` saying why not."""
        if not isinstance(url, str) or not url:
            raise MediaError("image_url.url must be a non-empty string")
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_image(self._load_data_url(url), self.limits)
        if scheme == "file":
            return decode_image(self._load_file(url), self.limits)
        if scheme in ("http", "https"):
            if not self.allow_http:
                raise MediaError("http(s) image URLs are disabled on this server")
            return decode_image(self._fetch_http(url), self.limits)
        raise MediaError(
            f"image URL scheme {scheme!r} is not supported; use data:, file:// or http(s)://"
        )

    def _load_data_url(self, url: str) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep:
            raise MediaError("malformed data: URL (no ',' before the payload)")
        parts = header.split(";")
        media_type = parts[0]
        _check_image_media_type(media_type, "data: URL")
        if "base64" not in (p.strip().lower() for p in parts[1:]):
            raise MediaError("data: URL images must be base64-encoded (';base64,')")
        # base64 grows data by 4/3: refuse before decoding a payload over the limit.
        if len(payload) * 3 // 4 > self.limits.max_image_bytes + 3:
            raise MediaError(
                f"image is about {len(payload) * 3 // 4} bytes, more than the limit of "
                f"{self.limits.max_image_bytes} bytes"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"data: URL payload is not valid base64: {e}") from e

    def _load_file(self, url: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaError(
                "file:// image URLs are disabled; start the server with "
                "--allowed-local-media-path to allow a directory"
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file:// URL names a remote host {parts.netloc!r}")
        path = Path(urllib.request.url2pathname(parts.path)).resolve()
        if not path.is_relative_to(root):
            raise MediaError(
                f"file {str(path)!r} is outside the allowed local media path {str(root)!r}"
            )
        try:
            size = path.stat().st_size
            if size > self.limits.max_image_bytes:
                raise MediaError(
                    f"image file is {size} bytes, more than the limit of "
                    f"{self.limits.max_image_bytes} bytes"
                )
            return path.read_bytes()
        except OSError as e:
            raise MediaError(f"cannot read image file {str(path)!r}: {e.strerror}") from e

    def _fetch_http(self, url: str) -> bytes:
        return fetch_media_bytes(
            url,
            self.url_policy,
            max_bytes=self.limits.max_image_bytes,
            timeout_s=self.limits.fetch_timeout_s,
            check_content_type=_check_image_media_type,
        )
