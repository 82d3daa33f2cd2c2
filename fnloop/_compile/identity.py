"""What a step's graph depends on besides its inputs, as a key computed without tracing it.

A restarted run (a preemption, a crash: what exact resume exists for) needs
the graph it compiled before. The compile cache (``cache.py``) finds it by the
traced graph, so a warm start would trace the step again (``make_fx`` on fake
tensors, most of a warm start's seconds) only to learn that key. Instead, the
first run also writes a start file under a key of what the trace read
(``Jit``): this module's ``fingerprint`` of the step's objects, and the call's
structure and tensors' signature. A later process with the same key loads the
graph and traces nothing. The key is built to miss whenever the graph could
differ:

- **Values**, walked: a module's type, every attribute (numbers, strings,
  configs, flags, ``training``), its parameters' and buffers' names, shapes,
  dtypes and devices (their values are the step's inputs), its hooks; a
  function's defaults and closure (an optimizer's learning rate lives in
  one) and, for code of one's own, its code and every global it reads; a
  tensor's values (a tensor a closure captured is baked into the graph).
- **Code**: code of one's own (outside the installed distributions and the
  standard library: a script, a notebook's cells, a package being worked on)
  by content, as above, and its files by size and modification time (what
  Python's own ``.pyc`` check compares); installed code by the names and
  versions of the installed distributions (a ``pip install`` changes them);
  torch by version and build.
- **Settings** a trace reads: the default dtype, the matmul precision, the
  deterministic algorithms flag, the attention kernels enabled, grad mode.

What the walk cannot describe without a per-process id (an object whose only
description is its address) makes ``fingerprint`` return ``None``: such a step
is traced, as before. Not covered: a module-level variable of installed code
changed at run time (a registry of a library's), which the graph would read.
``FNLOOP_CACHE_DIR=off`` turns the cache off, and with it this key.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import sys
import types
import weakref
from collections.abc import Iterator

import attrs
import torch

from fnloop._compile.loaded import is_installed

__all__ = ["Unstable", "fingerprint"]

_FORMAT = "fnloop-fingerprint 1"
_LIMIT = 200_000
"""The most objects one walk visits before it gives up (a key is then not worth its time)."""


class Unstable(Exception):
    """An object the walk cannot describe without something per process (its address)."""


def fingerprint(*objects: object) -> str | None:
    """A hash of ``objects`` (values and code, walked as the module says), or ``None`` if one cannot be described.

    Examples:
        >>> fingerprint(1.0, "a") == fingerprint(1.0, "a"), fingerprint(1.0) == fingerprint(2.0)
        (True, False)
        >>> fingerprint(lambda x: x * 2) == fingerprint(lambda x: x * 3)
        False
    """
    walk = _Walk()
    try:
        walk.put(_global_hooks())
        for value in objects:
            walk.put(value)
    except Unstable:
        return None
    except RecursionError:
        return None
    return walk.hasher.hexdigest()


def _global_hooks() -> list[object]:
    """The hooks registered for every module (``register_module_forward_hook``, ...), which a trace runs."""
    from torch.nn.modules import module

    return [
        value
        for name, value in sorted(vars(module).items())
        if name.startswith("_global_") and "hook" in name
    ]


_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)
_MODULE_OWN = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_SKIPPED_MODULE_KEYS = frozenset({"_compiled_call_impl"})
_CLASS_OWN = frozenset(
    {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "_abc_impl", "__firstlineno__"}
)
"""A class's entries that Python keeps for itself: its abstract-method cache is described by its address."""
_PER_PROCESS = frozenset({"_original_object_hash"})
"""Attributes known to hold something per process and nothing a graph reads (a ``GenerationConfig``'s hash of itself)."""


class _Walk:
    """One walk over objects, hashing what it meets; each object once (a back-reference after)."""

    def __init__(self) -> None:
        self.hasher = hashlib.sha256(_FORMAT.encode())
        self.seen: dict[int, int] = {}
        self.keep: list[object] = []  # the objects seen, kept alive so that their ids stay theirs

    def emit(self, *parts: object) -> None:
        for part in parts:
            self.hasher.update(repr(part).encode())
            self.hasher.update(b"\x00")

    def put(self, value: object) -> None:
        if isinstance(value, _ATOMS):
            self.emit(type(value).__name__, value)
            return
        if isinstance(value, _NAMED):
            self.emit(type(value).__name__, str(value))
            return
        key = id(value)
        if key in self.seen:
            self.emit("ref", self.seen[key])
            return
        self.seen[key] = len(self.seen)
        self.keep.append(value)
        if len(self.seen) > _LIMIT:
            raise Unstable("too many objects")
        self._put(value)

    def _put(self, value: object) -> None:
        if isinstance(value, enum.Enum):
            self.emit("enum", _name(type(value)), value.name)
        elif isinstance(value, (tuple, list)):
            self.emit(_name(type(value)), len(value))
            for item in value:
                self.put(item)
        elif isinstance(value, dict):
            self.emit(_name(type(value)), len(value))
            for k, v in value.items():
                self.put(k)
                self.put(v)
        elif isinstance(value, (set, frozenset)):
            self.emit(_name(type(value)), sorted(fingerprint(item) or "?" for item in value))
        elif isinstance(value, torch.nn.Module):
            self._module(value)
        elif isinstance(value, torch.Tensor):
            self._tensor(value)
        elif isinstance(value, types.FunctionType):
            self._function(value)
        elif isinstance(value, types.MethodType):
            self.emit("method")
            self.put(value.__func__)
            self.put(value.__self__)
        elif isinstance(value, functools.partial):
            self.emit("partial")
            self.put(value.func)
            self.put(value.args)
            self.put(value.keywords)
        elif isinstance(value, type):
            self._class(value)
        elif isinstance(value, types.ModuleType):
            self.emit("module", value.__name__)
        elif isinstance(value, logging.Logger):
            self.emit("logger", value.name)
        elif isinstance(value, weakref.ref):
            self.emit("weakref")
            self.put(value())
        elif isinstance(value, types.CodeType):
            self._code(value)
        elif isinstance(
            value, (types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodWrapperType)
        ):
            self.emit(
                "builtin", getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value))
            )
            owner = getattr(value, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType):
                self.put(owner)
        elif isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            self.emit("op", str(value))
        elif attrs.has(type(value)):
            self.emit("attrs", _name(type(value)))
            for field in attrs.fields(type(value)):  # type: ignore[arg-type]
                if field.eq:  # a field out of the value's equality is not part of it (a cache, a flag)
                    self.emit(field.name)
                    self.put(getattr(value, field.name))
        else:  # a dataclass too: its instance may hold more than its fields (a config's private settings)
            self._object(value)

    def _module(self, module: torch.nn.Module) -> None:
        self.emit("nn.Module")
        self._class(type(module))
        state = vars(module)
        for name in ("_parameters", "_buffers"):
            for key, tensor in state[name].items():
                self.emit(name, key)
                if tensor is None:
                    self.emit(None)
                else:  # the values are the step's inputs; what the graph sees of them is their form
                    self.emit(tuple(tensor.shape), tensor.dtype, str(tensor.device), tensor.requires_grad)
                    if id(tensor) not in self.seen:  # met again (a list of the weights): a back-reference
                        self.seen[id(tensor)] = len(self.seen)
                        self.keep.append(tensor)
        self.emit(sorted(state.get("_non_persistent_buffers_set", ())))
        for key, child in state["_modules"].items():
            self.emit("child", key)
            self.put(child)
        for key in sorted(k for k in state if k not in _MODULE_OWN and k not in _SKIPPED_MODULE_KEYS):
            self.emit(key)
            self.put(state[key])

    def _tensor(self, tensor: torch.Tensor) -> None:
        # A tensor outside a module's parameters and buffers is baked into the graph: its values count.
        self.emit("tensor", tuple(tensor.shape), tensor.stride(), tensor.dtype, str(tensor.device))
        self.emit(tensor.requires_grad, type(tensor).__name__)
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_meta:
            raise Unstable("a tensor subclass or a tensor without values")
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.hasher.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")

    def _function(self, function: types.FunctionType) -> None:
        self.emit("function", function.__module__, function.__qualname__)
        # Defaults and the closure are values, whoever wrote the code (an optimizer's settings).
        self.put(function.__defaults__)
        self.put(function.__kwdefaults__)
        for cell in function.__closure__ or ():
            try:
                self.put(cell.cell_contents)
            except ValueError:  # an empty cell
                self.emit("empty cell")
        if _installed_code(function.__module__):
            return  # installed code: its distribution's version stands for it
        self._code(function.__code__)
        for name in sorted(_names(function.__code__)):
            if name in function.__globals__:
                self.emit("global", name)
                self.put(function.__globals__[name])

    def _code(self, code: types.CodeType) -> None:
        self.emit("code", code.co_name, code.co_argcount, code.co_kwonlyargcount, code.co_flags)
        self.emit(code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
        self.hasher.update(code.co_code)
        for const in code.co_consts:
            self.put(const)

    def _class(self, cls: type) -> None:
        self.emit("class", cls.__module__, cls.__qualname__)
        if cls.__module__ == "builtins" or _installed_code(cls.__module__):
            return
        # A class of one's own (a script's, a notebook's): its body, and its bases'.
        for base in cls.__mro__[1:]:
            self.put(base)
        for key, value in sorted(vars(cls).items()):
            if key in _CLASS_OWN:
                continue
            self.emit(key)
            self.put(value)

    def _object(self, value: object) -> None:
        cls = type(value)
        self.emit("object")
        self._class(cls)
        if isinstance(value, (staticmethod, classmethod)):
            self.put(value.__func__)
            return
        if isinstance(value, property):
            self.put((value.fget, value.fset, value.fdel))
            return
        state = getattr(value, "__dict__", None)
        slots = [s for c in cls.__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
        if state is None and not slots:
            text = repr(value)
            if " at 0x" in text or "object at" in text:
                raise Unstable(f"{_name(cls)} is described by its address alone")
            self.emit(text)
            return
        if state is not None:
            self.put({k: v for k, v in sorted(state.items()) if k not in _PER_PROCESS})
        for slot in slots:
            if hasattr(value, slot):
                self.emit(slot)
                self.put(getattr(value, slot))


def _installed_code(module: str) -> bool:
    """Whether the module named ``module`` is loaded from the standard library or an installed distribution."""
    return is_installed(getattr(sys.modules.get(module), "__file__", None))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` and the code nested in it read."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)
