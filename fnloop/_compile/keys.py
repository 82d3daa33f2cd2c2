"""The keys of the compile cache: a graph's (its traced graph), and a start file's (what the trace would read).

``graph_key`` hashes what inductor builds from: the graph, its inputs'
layout, inductor's configuration, torch's build and the machine (see
``cache.py``). ``start_key`` hashes what the trace would read, so that a
restarted run finds its graph without tracing (see ``identity.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fnloop._compile.loaded import installed, local_files, settings

__all__ = ["GRAPH_FORMAT", "START_FORMAT", "graph_key", "start_key"]

GRAPH_FORMAT = b"fnloop-compiled-graph 1\n"
"""The first line of every graph file, and the first part of its key: a new format keys anew."""
START_FORMAT = b"fnloop-start 1\n"
"""The first line of every start file, and the first part of its key."""


def graph_key(graph: torch.fx.GraphModule, leaves: Sequence[torch.Tensor], options: Mapping[str, Any]) -> str:
    """A hash of everything that shapes what inductor builds from ``graph`` called on ``leaves``.

    Examples:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> x = torch.ones(3)
        >>> g = make_fx(lambda t: [t * 2])(x)
        >>> h = make_fx(lambda t: [t * 3])(x)
        >>> graph_key(g, [x], {}) == graph_key(g, [x], {}), graph_key(g, [x], {}) == graph_key(h, [x], {})
        (True, False)
    """
    hasher = hashlib.sha256()

    def put(*parts: object) -> None:
        for part in parts:
            hasher.update(repr(part).encode())
            hasher.update(b"\x00")

    put(GRAPH_FORMAT, torch.__version__, torch.version.git_version, torch.version.cuda, torch.version.hip)
    put(sys.version, platform.machine(), sys.platform)
    _put_graph(put, hasher, graph, "")
    storages: dict[tuple[str, int], tuple[int, int]] = {}
    for index, leaf in enumerate(leaves):
        put(tuple(leaf.shape), leaf.stride(), *_placed(leaf, storages, index), leaf.dtype, leaf.requires_grad)
        put(*_device(leaf.device))
    # Inductor lowers some ops otherwise under torch's deterministic algorithms (an accumulating index_put).
    put(_inductor_config(options), torch.are_deterministic_algorithms_enabled())
    return hasher.hexdigest()


def start_key(
    identity: str,
    structure: str,
    leaves: Sequence[torch.Tensor],
    options: Mapping[str, Any],
    no_random: str | None,
) -> str:
    """A hash of everything a step's graph depends on, computed without tracing it (see ``identity.py``).

    ``identity``: the ``fingerprint`` of what the traced function reads
    (the model, the loss function, the optimizer, ...); ``structure``: the
    call's structure, as text; ``leaves``: the call's tensors, of which the
    signature counts, as in ``graph_key``; ``options``: inductor's settings
    as given; ``no_random``: the refusal a graph drawing from the generator
    meets. Beside them: the code (``installed``, ``local_files``), torch's
    settings, the machine and this file's format.
    """
    hasher = hashlib.sha256()

    def put(*parts: object) -> None:
        for part in parts:
            hasher.update(repr(part).encode())
            hasher.update(b"\x00")

    put(START_FORMAT, identity, structure, no_random, installed(), local_files(), settings())
    put(platform.machine(), sys.platform)
    storages: dict[tuple[str, int], tuple[int, int]] = {}
    for index, leaf in enumerate(leaves):
        put(tuple(leaf.shape), leaf.stride(), *_placed(leaf, storages, index), leaf.dtype, leaf.requires_grad)
        put(*_device(leaf.device))
    put(_inductor_config(options))
    return hasher.hexdigest()


def _put_graph(put: Any, hasher: Any, graph: torch.fx.GraphModule, prefix: str) -> None:
    put(prefix, graph.code)
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _attribute(graph, node.target)
        if isinstance(value, torch.fx.GraphModule):
            _put_graph(put, hasher, value, f"{prefix}{node.target}.")
        elif isinstance(value, torch.Tensor):
            put(node.target, tuple(value.shape), value.stride(), value.dtype, *_device(value.device))
            # The value itself: a closure's tensor is baked into the graph.
            hasher.update(
                value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
        else:
            put(node.target, *_opaque(value))


def _attribute(graph: torch.nn.Module, target: str) -> Any:
    value: Any = graph
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _opaque(value: object) -> tuple[object, ...]:
    """What identifies an attribute that is neither a tensor nor a graph, without any per-process id."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    described: list[object] = [kind]
    for name in ("group_name", "group_desc"):
        with contextlib.suppress(Exception):
            described.append((name, getattr(value, name)))
    with contextlib.suppress(Exception):
        described.append(("size", value.size()))  # type: ignore[attr-defined]
    if isinstance(value, (int, float, str, bool, bytes, type(None))):
        described.append(value)
    return tuple(described)


ALIGNMENT = 16
"""Bytes: inductor assumes an input that starts at a multiple of this stays so (and copies one that does not)."""


def _placed(
    leaf: torch.Tensor, seen: dict[tuple[str, int], tuple[int, int]], index: int
) -> tuple[object, ...]:
    """Where ``leaf`` lies in its storage, as far as a graph depends on it; addresses must not enter a key.

    Whether its start is aligned (what inductor assumes of it), the first
    leaf sharing its storage and how far from that leaf's start it begins
    (aliasing shapes the graph). Not the offset itself: the compiled graph
    takes a tensor wherever it starts, as the in-memory signature does, so
    the ranks of a job given their rows of one batch (views at other
    offsets) find one graph, and one rank builds it.
    """
    offset = int(leaf.storage_offset())
    try:
        pointer = leaf.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return offset, index, 0
    first, start = seen.setdefault((str(leaf.device), pointer), (index, offset))
    return offset * leaf.element_size() % ALIGNMENT == 0, first, offset - start


def _device(device: torch.device) -> tuple[object, ...]:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (device.type, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    return (device.type,)


def _inductor_config(options: Mapping[str, Any]) -> str:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(dict(options)):
        settings = inductor_config.save_config_portable()
    return repr(
        (
            sorted(settings.items(), key=_first),
            sorted(functorch_config.save_config_portable().items(), key=_first),
        )
    )


def _first(item: tuple[str, Any]) -> str:
    return item[0]
