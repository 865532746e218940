"""What identifies a model's weights, for the engine adapters' namespaces.

A namespace must change when the bytes a KV block holds would change. A model's path does not
say that: new weights written to the same directory (a fine-tune saved over the old one, a
re-download of another revision) keep the path and change every KV byte. ``weights_identity``
stamps the weight files themselves: their names, sizes and modification times, and the bytes
of the model's ``config.json``. Reading every weight byte would be exact but costs seconds per
GiB at engine start; a stamp changes whenever a file is rewritten, which is what happens when
weights change in place. Two copies of the same weights in two directories get two stamps
(a miss, never a wrong hit).

An operator who knows better (a content digest from the model registry) passes it as the
adapter's ``model_identity`` setting, which replaces the stamp.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
MAX_FILES = 100_000  # a bound on the directory walk


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
        st = os.stat(p)
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if p.name == "config.json":
            h.update(p.read_bytes())
    return "w:" + h.hexdigest()[:32]
