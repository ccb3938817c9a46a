"""The batch's input and output: local files or http(s) URLs, as vLLM 0.33.

vLLM (entrypoints/launchers/run_batch.py:359-512, 868-911) reads the input
from a path or an http(s) URL (GET) and writes the output to a path, or to a
URL with a PUT once the batch is done; it refuses an output that is the input
file, a directory or not writable before the model loads. So does paged.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from urllib.parse import urlparse

import httpx

_HTTP_TIMEOUT_S = 1000.0  # vLLM's upload timeout (aiohttp ClientTimeout(total=1000))


def is_url(path_or_url: str) -> bool:
    return urlparse(path_or_url).scheme in ("http", "https")


def check_batch_files(input_file: str, output_file: str) -> None:
    """ValueError naming the flag for paths that cannot work (checked before the model loads)."""
    if not is_url(input_file) and not os.path.isfile(input_file):
        raise ValueError(f"--input-file {input_file}: no such file")
    if is_url(output_file):
        return
    if not is_url(input_file) and os.path.exists(output_file):
        a, b = os.stat(input_file), os.stat(output_file)
        if stat.S_ISREG(b.st_mode) and os.path.samestat(a, b):
            raise ValueError(
                f"--input-file and --output-file are the same file ({output_file}); the "
                "outputs are written while the batch runs and would overwrite the input"
            )
    if os.path.isdir(output_file):
        raise ValueError(f"--output-file {output_file} is a directory")
    parent = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(parent):
        raise ValueError(f"--output-file: directory {parent} does not exist")
    target = output_file if os.path.exists(output_file) else parent
    if not os.access(target, os.W_OK):
        raise ValueError(f"--output-file {output_file} is not writable")


def read_batch_input(input_file: str) -> list[str]:
    """The input's lines (a URL is fetched with GET)."""
    if is_url(input_file):
        resp = httpx.get(input_file, timeout=_HTTP_TIMEOUT_S, follow_redirects=True)
        if resp.status_code != 200:
            raise ValueError(f"--input-file {input_file}: HTTP {resp.status_code}")
        return resp.text.splitlines()
    with open(input_file, encoding="utf-8") as f:
        return f.read().splitlines()


class BatchOutput:
    """Where output lines go: appended to a local file as they come (flushed each
    line, so a stopped run leaves a prefix), or kept and PUT to a URL at `close()`."""

    def __init__(self, output_file: str) -> None:
        self.target = output_file
        self._lines: list[str] = []
        self._file = None if is_url(output_file) else open(output_file, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, line: str) -> None:
        if self._file is None:
            self._lines.append(line)
            return
        self._file.write(line + "\n")
        self._file.flush()

    def close(self, upload: Callable[..., httpx.Response] = httpx.put) -> None:
        if self._file is not None:
            self._file.close()
            return
        data = "".join(line + "\n" for line in self._lines).encode()
        resp = upload(self.target, content=data, timeout=_HTTP_TIMEOUT_S)
        if resp.status_code >= 300:
            raise RuntimeError(f"--output-file {self.target}: upload got HTTP {resp.status_code}")
