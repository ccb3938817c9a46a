"""MultiModalHasher: equal pictures hash equal whatever their source; different ones never."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from paged.multimodal.hasher import MultiModalHasher

MODES = st.sampled_from(["RGB", "RGBA", "L"])


@st.composite
def images(draw: st.DrawFn) -> Image.Image:
    mode = draw(MODES)
    w = draw(st.integers(1, 6))
    h = draw(st.integers(1, 6))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    raw = draw(st.binary(min_size=w * h * channels, max_size=w * h * channels))
    return Image.frombytes(mode, (w, h), raw)


def _roundtrip_png(image: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    out = Image.open(io.BytesIO(buf.getvalue()))
    out.load()
    return out


@settings(max_examples=150, deadline=None)
@given(images(), images())
def test_hash_equal_iff_same_mode_size_pixels(a: Image.Image, b: Image.Image) -> None:
    same = a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()
    assert (MultiModalHasher.hash_kwargs(image=a) == MultiModalHasher.hash_kwargs(image=b)) == same


@settings(max_examples=60, deadline=None)
@given(images())
def test_same_picture_through_an_encoded_file_hashes_equal(image: Image.Image) -> None:
    assert MultiModalHasher.hash_kwargs(image=image) == MultiModalHasher.hash_kwargs(
        image=_roundtrip_png(image)
    )


@settings(max_examples=60, deadline=None)
@given(images(), st.integers(0, 5), st.integers(0, 255))
def test_one_changed_pixel_changes_the_hash(image: Image.Image, where: int, delta: int) -> None:
    arr = np.array(image)
    flat = arr.reshape(-1)
    i = where % flat.size
    flat[i] = (int(flat[i]) + 1 + delta % 255) % 256
    changed = Image.fromarray(arr, mode=image.mode)
    assert MultiModalHasher.hash_kwargs(image=changed) != MultiModalHasher.hash_kwargs(image=image)


def test_palette_and_kwargs_count_and_fips_fallback_is_stable() -> None:
    p1 = Image.new("P", (2, 2))
    p1.putpalette([0, 0, 0] * 256)
    p2 = Image.new("P", (2, 2))
    p2.putpalette([255, 0, 0] * 256)  # same indices, other colours
    assert p1.tobytes() == p2.tobytes()
    assert MultiModalHasher.hash_kwargs(image=p1) != MultiModalHasher.hash_kwargs(image=p2)
    img = Image.new("RGB", (3, 3))
    assert MultiModalHasher.hash_kwargs(image=img, model_id="a") != MultiModalHasher.hash_kwargs(
        image=img, model_id="b"
    )
    # Injective framing: moving bytes between fields changes the hash.
    assert MultiModalHasher.hash_kwargs(a="xy", b="z") != MultiModalHasher.hash_kwargs(
        a="x", b="yz"
    )
    fips = MultiModalHasher.hash_kwargs(use_fips=True, image=img)
    assert len(fips) == 64 and fips == MultiModalHasher.hash_kwargs(use_fips=True, image=img)
    assert MultiModalHasher.algorithm() in ("blake3", "sha256")
    arr = np.arange(6, dtype=np.float32)
    assert MultiModalHasher.hash_kwargs(x=arr) != MultiModalHasher.hash_kwargs(x=arr.reshape(2, 3))
