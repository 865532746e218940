"""What identifies a model's weights, for the engine adapters' namespaces.

A namespace must change when the bytes a KV block holds would change. A model's path does not
say that: new weights written to the same directory (a fine-tune saved over the old one, a
re-download of another revision) keep the path and change every KV byte. And it must not change
where the bytes would not: the same weights on two nodes (downloaded at different times, to
different directories) must name one namespace, or no block moves between them.

``weights_identity`` stamps the weight files' contents without reading them whole (that costs
seconds per GiB at every engine start): each weight file's name relative to the model directory,
its size, and ``SAMPLES`` evenly spaced ``SAMPLE_BYTES`` runs of its bytes (the first and the
last included), plus the bytes of ``config.json``. New weights differ in every sampled run, so
they get a new stamp; copies of the same files get the same stamp wherever they are; file times
play no part.

An operator who knows better (a content digest from the model registry) passes it as the
adapter's ``model_identity`` setting, which replaces the stamp.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
MAX_FILES = 100_000  # a bound on the directory walk
SAMPLES = 16  # runs read per weight file
SAMPLE_BYTES = 64 * 1024


def _sample(h: "hashlib._Hash", path: Path, size: int) -> None:
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
            return
        step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
        for i in range(SAMPLES):
            f.seek(i * step)
            h.update(f.read(SAMPLE_BYTES))


def weights_identity(model: str) -> str:
    """A stamp of the weights under ``model`` (a local directory or file), or ``""`` when the
    path is not local (a hub id the engine resolves itself: the caller falls back to the name
    and revision, and says so)."""
    root = Path(model)
    if root.is_file():
        files = [root]
        root = root.parent
    elif root.is_dir():
        files = []
        for i, p in enumerate(sorted(root.rglob("*"))):
            if i >= MAX_FILES:
                raise ValueError(f"more than {MAX_FILES} files under {model}: pass model_identity")
            if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"):
                files.append(p)
    else:
        return ""
    h = hashlib.sha256()
    for p in files:
        size = os.stat(p).st_size
        h.update(f"{p.relative_to(root)}\0{size}\0".encode())
        if p.name == "config.json":
            h.update(p.read_bytes())
        else:
            _sample(h, p, size)
    return "w:" + h.hexdigest()[:32]
