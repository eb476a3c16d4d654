"""Lightning hooks that only say which hook ran: each defined once, as a call of one method with its name.

>>> class Probe:
...     def seen(self, trainer, hook): print(trainer, hook)
>>> route_hooks(Probe, ("on_train_epoch_end",), to="seen")
>>> Probe().on_train_epoch_end("trainer", "module")
trainer on_train_epoch_end
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["route_hooks"]


def _route(name: str, to: str) -> Callable[..., None]:
    def hook(self: Any, trainer: Any, pl_module: Any, *args: Any) -> None:
        getattr(self, to)(trainer, name)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Lightning's ``{name}``: ``self.{to}(trainer, {name!r})``."
    return hook


def route_hooks(cls: type, names: Sequence[str], *, to: str) -> None:
    """Define each Lightning hook in ``names`` on ``cls`` (``(trainer, pl_module, *args)``, the batch hooks'
    extra arguments ignored) as ``self.<to>(trainer, name)``."""
    for name in names:
        setattr(cls, name, _route(name, to))
