"""Task registry: `config.task` names a Task class; modules are imported only when asked for.

A task named `x` lives in `attnlab/tasks/x.py` and registers itself with `@register_task("x")`.
`get_task("x")` imports only that module, so a heavy or broken task module never slows or breaks
the others. A module may register further names; those are found by importing every task module,
which happens only when the fast path misses (and to list the valid names in the error).
"""

from __future__ import annotations

import importlib
import os
import importlib.util
import pkgutil
from collections.abc import Callable

import ml_collections

from attnlab.data.pipeline import IndexedBatches
from attnlab.errors import UserError
from attnlab.tasks.base import BatchIterator
from attnlab.tasks.base import Task

__all__ = ["BatchIterator", "IndexedBatches", "Task", "build_task", "get_task", "register_task"]

_REGISTRY: dict[str, type[Task]] = {}
# Modules of this package that are not tasks.
_NOT_TASK_MODULES = frozenset({"base"})


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
  """Class decorator: makes `config.task = name` select this Task subclass."""
  def decorator(cls: type[Task]) -> type[Task]:
    if not (isinstance(cls, type) and issubclass(cls, Task)):
      raise TypeError(f"register_task({name!r}) decorates Task subclasses, got {cls!r}")
    previous = _REGISTRY.get(name)
    if previous is not None and previous.__qualname__ != cls.__qualname__:
      raise ValueError(f"task name {name!r} is already registered by {previous.__module__}."
                       f"{previous.__qualname__}; pick another name")
    cls.name = name
    _REGISTRY[name] = cls
    return cls
  return decorator


def _import_all() -> dict[str, str]:
  """Imports every task module; returns {module: error} for those that failed."""
  failed = {}
  for module in sorted(m.name for m in pkgutil.iter_modules(__path__)
                       if m.name not in _NOT_TASK_MODULES):
    try:
      importlib.import_module(f"{__name__}.{module}")
    except Exception as e:  # a broken module must not hide the others' names
      failed[module] = f"{type(e).__name__}: {e}"
  return failed


def get_task(name: str) -> type[Task]:
  """The Task class registered as `name`; raises a UserError (ValueError) listing valid names."""
  if name in _REGISTRY:
    return _REGISTRY[name]
  if name.isidentifier() and name not in _NOT_TASK_MODULES and importlib.util.find_spec(
      f"{__name__}.{name}") is not None:
    importlib.import_module(f"{__name__}.{name}")  # errors in the task's own module propagate
    if name in _REGISTRY:
      return _REGISTRY[name]
  failed = _import_all()
  if name in _REGISTRY:
    return _REGISTRY[name]
  note = "".join(f"; module {m} failed to import ({err})" for m, err in failed.items())
  raise UserError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(_REGISTRY))}{note}")


def build_task(config: ml_collections.ConfigDict, assets: str | os.PathLike | None = None) -> Task:
  """The task named by `config.task`, built from the config (and a run's assets folder, whose
  vocabularies and sizes replace those of the data: attnlab.data.assets)."""
  cls = get_task(config.task)
  # Only given when there is a folder: a task written without the argument still runs new runs.
  return cls(config, assets) if assets is not None else cls(config)
