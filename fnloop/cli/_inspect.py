"""``fnloop inspect CKPT``: what a checkpoint holds, as aligned text or as JSON.

Every field, each tensor with its dtype, shape and a summary, hook states,
the latest value of each metric, and the file's format and size.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fnloop._core.config import flat
from fnloop.checkpoint import Record
from fnloop.checkpoint._raw import (
    Row,
    compact,
    is_tensor,
    json_number,
    leaves,
    many,
    read,
    short,
    table,
    tensor_stats,
)
from fnloop.checkpoint._safetensors import INDEX

__all__ = ["run"]

_HEAD_FIELDS = ("rng", "data", "time")
_MOST = 20  # entries shown of a long list; the rest are counted (the JSON holds them all)


def _metric_rows(metrics: Any) -> tuple[int | None, list[tuple[str, int, Any, int]]] | None:
    """(window, [(name, iteration, latest value, entries kept)]) or ``None`` if not a Metrics record."""
    if type(metrics) is not Record or type(metrics.get("series")) is not dict:
        return None
    rows = []
    for name, entries in metrics["series"].items():
        if (
            type(entries) is not tuple
            or not entries
            or type(entries[-1]) is not tuple
            or len(entries[-1]) != 2
        ):
            return None
        iteration, value = entries[-1]
        if is_tensor(value):
            value = tensor_stats(value).get("value", value)
        rows.append((str(name), iteration, value, len(entries)))
    window = metrics.get("window")
    return (window if type(window) is int else None), rows


def _inspect_json(path: Path, metadata: dict[str, str], tree: Record) -> dict[str, Any]:
    out: dict[str, Any] = {
        "file": {
            "path": str(path),
            "size": path.stat().st_size,
            "format": metadata.get("fnloop.format"),
            "fnloop_version": metadata.get("fnloop.version"),
            "checksum": metadata.get("fnloop.checksum"),
        }
    }
    if INDEX in metadata:
        out["file"]["shards"] = json.loads(metadata[INDEX])
    for name, value in tree.items():
        if name == "metrics" and (found := _metric_rows(value)) is not None:
            window, entries = found
            out[name] = {
                "window": window,
                "latest": {n: {"iteration": i, "value": _jsonable(v), "kept": k} for n, i, v, k in entries},
            }
        else:
            out[name] = _jsonable(value)
    return out


def _tensor_text(t: Any) -> tuple[str, str, str]:
    """(dtype, shape, summary) columns for one tensor."""
    s = tensor_stats(t)
    if "value" in s:
        summary = compact(s["value"])
    elif t.dtype is torch.bool:
        summary = f"{s['true']} true" if "true" in s else ""
    elif "nan" in s and "mean" not in s:
        summary = f"no finite values ({s['nan']} nan, {s['inf']} inf)"
    elif "mean" in s:
        summary = f"norm {compact(s['norm'])}  mean {compact(s['mean'])}  min {compact(s['min'])}  max {compact(s['max'])}"
        if "nan" in s:
            summary += f"  (of the finite values; {s['nan']} nan, {s['inf']} inf)"
    else:
        summary = f"norm {compact(s['norm'])}" if "norm" in s else "empty"
    return s["dtype"], str(tuple(t.shape)), summary


def _jsonable(value: Any) -> Any:
    if is_tensor(value):
        return tensor_stats(value)
    if type(value) is Record:
        return {"__type__": value.type, **{k: _jsonable(v) for k, v in value.items()}}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return json_number(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)  # a Phase


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError  # unreachable


def _section(named: Iterable[tuple[str, Any]]) -> tuple[str, list[Row]]:
    """A heading note and rows for ``(name, leaf)`` pairs: tensors with dtype, shape and summary."""
    rows: list[Row] = []
    count, numel, nbytes = 0, 0, 0
    for name, leaf in named:
        if is_tensor(leaf):
            count, numel = count + 1, numel + leaf.numel()
            nbytes += leaf.numel() * leaf.element_size()
            rows.append((name, *_tensor_text(leaf)))
        else:
            rows.append((name, short(leaf)))
    note = f"{many(count, 'tensor')}, {many(numel, 'element')}, {_size(nbytes)}" if count else ""
    return note, rows


def _named(value: Any, by_key: bool) -> Iterator[tuple[str, Any]]:
    """Leaves of a field, named by their path in it; ``by_key``: a name -> tensor dict's keys as they are."""
    if by_key and type(value) is dict and value:
        for key, child in value.items():
            yield from leaves(child, str(key), most=_MOST)
    else:
        yield from ((path.removeprefix(".") or "(all)", leaf) for path, leaf in leaves(value, most=_MOST))


def _inspect_text(path: Path, metadata: dict[str, str], tree: Record) -> list[str]:
    head = [
        ("file", f"{path}  ({_size(path.stat().st_size)})"),
        (
            "format",
            f"{metadata.get('fnloop.format')}, written by fnloop {metadata.get('fnloop.version')}, "
            f"{metadata.get('fnloop.checksum')}",
        ),
        ("iteration", f"{short(tree.get('iteration'))} / {short(tree.get('max_iter'))}"),
    ]
    index = metadata.get(INDEX)
    if index is not None:
        layout = json.loads(index)
        head.insert(2, ("shards", f"{layout['world']} parts ({layout['mode']}), shown whole"))
    population = tree.get("population")
    if isinstance(population, dict) and population.get("labels"):
        labels, stopped = population["labels"], population.get("stopped", ())
        done = sum(1 for s in stopped if isinstance(s, int) and s >= 0)
        head.insert(2, ("population", f"{len(labels)} members, {done} stopped: {'; '.join(labels)}"))
    head += [(name, short(tree[name])) for name in _HEAD_FIELDS if name in tree]
    lines = table(head, indent="")
    config = tree.get("config")
    if isinstance(config, dict):  # the run's settings, dotted, first: what a reader looks for
        settings = flat(config)
        lines += ["", f"config: {many(len(settings), 'setting')}"]
        lines += table([(key, short(value)) for key, value in settings.items()])
    for name, value in tree.items():
        if name in ("iteration", "max_iter", "population", *_HEAD_FIELDS) or (
            name == "config" and (config is None or isinstance(config, dict))
        ):
            continue
        lines.append("")
        if name == "metrics" and (found := _metric_rows(value)) is not None:
            window, entries = found
            if not entries:
                lines.append(f"metrics: none recorded (window {window})")
                continue
            lines.append(f"metrics: {many(len(entries), 'name')}, the last {window} entries of each kept")
            lines += table([(n, compact(v), f"at iteration {i}", f"({k} kept)") for n, i, v, k in entries])
            continue
        if name == "hooks" and isinstance(value, dict) and value:
            lines.append(f"hooks: {many(len(value), 'state')}")
            rows: list[Row] = []
            for hook, memory in value.items():
                text = short(memory)
                if len(text) < 100 and not any(is_tensor(v) for _, v in leaves(memory, most=_MOST)):
                    rows.append((hook, text))
                else:  # large: one row per leaf, under the hook's name
                    rows += _section(leaves(memory, hook, most=_MOST))[1]
            lines += table(rows)
            continue
        note, rows = _section(_named(value, by_key=name in ("params", "buffers")))
        if len(rows) == 1 and rows[0][0] == "(all)" and len(rows[0]) == 2:
            lines.append(f"{name}: {rows[0][1]}")
            continue
        lines.append(f"{name}: {note}" if note else f"{name}:")
        lines += table(rows)
    return lines


def run(args: argparse.Namespace) -> int:
    """Print what the checkpoint ``args.ckpt`` holds (as JSON with ``args.json``); return 0."""
    path, metadata, tree = read(args.ckpt, summarized=True)
    if args.json:
        print(json.dumps(_inspect_json(path, metadata, tree), indent=2))
    else:
        print("\n".join(_inspect_text(path, metadata, tree)))
    return 0
