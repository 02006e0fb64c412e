"""Subclasses of transformers' module classes made at run time (an adapter's forward mixed in front, or a decorator
applied), each made once per class and pickled as a call that makes it again: it has no importable name of its own,
so without that an adapted model would not pickle (torch.save of the model, a copy through pickle)."""

from __future__ import annotations

from collections.abc import Callable

import torch

_MADE: dict[tuple[Callable, type], type] = {}  # (maker, a transformers class) -> the subclass the maker made of it


def subclass_once(make: Callable[[type], type], cls: type) -> type:
    """`make(cls)`, made once per (make, cls). `make` is a module-level function (pickled by its name)."""
    if (make, cls) not in _MADE:
        made = make(cls)
        made.__reduce_ex__ = lambda module, protocol: (_rebuild, (make, cls, module.__getstate__()))
        _MADE[make, cls] = made
    return _MADE[make, cls]


def _rebuild(make: Callable[[type], type], cls: type, state: dict) -> torch.nn.Module:
    """An unpickled module of `make(cls)` (made again in a new process) with `state`."""
    module = torch.nn.Module.__new__(subclass_once(make, cls))
    module.__setstate__(state)
    return module
