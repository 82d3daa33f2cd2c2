"""What code and settings a process has loaded, as values a key can hold: for the start files (``keys.start_key``).

- ``installed()``: the installed distributions, by the names of their
  ``dist-info`` folders (name and version: a ``pip install`` changes them),
  torch's build, Python's;
- ``local_files()``: the code of one's own that is loaded (outside the
  installed distributions and the standard library), each file by size and
  modification time, as Python's own ``.pyc`` check compares them;
- ``settings()``: torch's process-wide settings a trace reads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["installed", "is_installed", "local_files", "settings"]


def settings() -> tuple[object, ...]:
    """torch's process-wide settings a trace reads."""
    found: list[object] = [
        torch.get_default_dtype(),
        str(torch.get_default_device()),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.is_anomaly_enabled(),
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_grad_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    ]
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        probe = getattr(torch.backends.cuda, name, None)
        found.append(probe() if callable(probe) else None)
    return tuple(found)


@functools.cache
def _installed_roots(resolve: bool = True) -> tuple[str, ...]:
    """The standard library's and the installed distributions' folders, links resolved or as written."""
    paths = sysconfig.get_paths()
    written = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    written += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    roots = {os.path.realpath(p) if resolve else os.path.abspath(p) for p in written}
    return tuple(sorted(root.rstrip(os.sep) + os.sep for root in roots))


@functools.lru_cache(maxsize=8192)
def is_installed(path: str | None) -> bool:
    """Whether ``path`` (a module's file) is the standard library's or an installed distribution's."""
    if not path:
        return False
    # Most paths are found as written; resolving the links of each looks at the disk (a warm start
    # asks for some 4,000 of torch's modules: 0.1 s).
    if os.path.abspath(path).startswith(_installed_roots(resolve=False)):
        return True
    return os.path.realpath(path).startswith(_installed_roots())


def installed() -> tuple[object, ...]:
    """The installed distributions (their ``dist-info`` folders' names: name and version), torch's build, Python's."""
    found: list[str] = []
    for root in _installed_roots():
        with contextlib.suppress(OSError):
            found += [n for n in os.listdir(root) if n.endswith((".dist-info", ".egg-info", ".egg-link"))]
    return (
        tuple(sorted(found)),
        torch.__version__,
        torch.version.git_version,
        torch.version.cuda,
        torch.version.hip,
        sys.version,
    )


def local_files() -> tuple[tuple[str, int, int], ...]:
    """The files of the code of one's own that is loaded: each loaded package's whole folder, each loaded module's file."""
    files: set[str] = set()
    generated = _generated_root()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or is_installed(path) or not path.endswith(".py"):
            continue
        if generated and os.path.realpath(path).startswith(generated):  # what inductor built and loaded
            continue
        if "." not in name and os.path.basename(path) == "__init__.py":
            files |= set(_package_files(os.path.dirname(path)))
        else:
            files.add(path)
    out = []
    for path in sorted(files):
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            out.append((path, stat.st_size, stat.st_mtime_ns))
    return tuple(out)


def _package_files(root: str) -> Iterator[str]:
    """The ``.py`` files of the package at ``root`` and of its subpackages (folders with an ``__init__.py``).

    A module it imports later (lazily, after the first compile) is counted
    from the start; a folder of data beside the code is not walked.
    """
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(
            d for d in subfolders if os.path.exists(os.path.join(folder, d, "__init__.py"))
        )
        yield from (os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))


def _generated_root() -> str | None:
    """inductor's cache folder, where the code it generates is loaded from (not code of one's own)."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is None:
        return None
    return os.path.realpath(utils.cache_dir()).rstrip(os.sep) + os.sep
