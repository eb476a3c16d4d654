"""Zero-code activation for the Hugging Face Trainer: ``WEIGHTSYNC_AUDIT`` adds the audit to every Trainer.

Lightning builds its callbacks from entry points (:mod:`~weightsync_audit.integrations.activation`);
``transformers`` has none, so the package ships a one-line ``weightsync_audit_hf.pth`` into
site-packages (the wheel and the editable install both carry it). Python runs that line when the
interpreter starts; it reads the variable and, unset or off (``0``, ``false``, ``no``, ``off``, empty),
stops there: nothing is imported. Set, it calls :func:`install`, which puts a :class:`TrainerHook` on
``sys.meta_path`` and imports nothing else (not torch, not transformers).

When (if ever) the process imports ``transformers.trainer``, the hook lets the module run as usual and
then wraps ``Trainer.__init__`` once (:func:`hook_trainer_module`): every Trainer built from then on,
subclasses included, gets ``WeightSyncAuditCallback.from_env()`` added after its own ``__init__``
(:func:`add_env_callback`), with the variable's options. A Trainer that already holds a callback built by
``from_env()`` gets no second one; next to a ``WeightSyncAuditCallback`` passed explicitly, the one added
here steps aside at train begin and warns, naming the variable's options that are dropped. A bad option
fails the Trainer's construction with a message naming it, as under Lightning. Anything else that goes
wrong here (another ``transformers`` whose ``Trainer`` is shaped differently, the package half
installed) is a :class:`~weightsync_audit.errors.WeightSyncWarning` and the Trainer is left untouched.

>>> hook = TrainerHook()
>>> hook.find_spec("json") is None   # every other module is left to the other finders
True
"""

from __future__ import annotations

import os
import sys
from typing import Any

from weightsync_audit.text import ENV_VAR

__all__ = [
    "HOOKED",
    "OFF",
    "PTH_NAME",
    "TARGET",
    "TrainerHook",
    "add_env_callback",
    "hook_trainer_module",
    "install",
    "is_on",
]

#: The module whose ``Trainer`` is wrapped.
TARGET = "transformers.trainer"
#: The name of the file shipped into site-packages (its one line is in the project root's copy).
PTH_NAME = "weightsync_audit_hf.pth"
#: Set on the wrapping ``__init__``, so that a Trainer class is wrapped once.
HOOKED = "__weightsync_audit_hook__"
#: The values of ``WEIGHTSYNC_AUDIT`` that mean off (the ``.pth`` line spells the same tuple).
OFF = ("", "0", "false", "no", "off")


def is_on(value: str | None) -> bool:
    """Whether the variable's value asks for the audit (what the ``.pth`` line decides before importing this).

    >>> [is_on(v) for v in (None, "", "0", "Off", "1", "every_n_steps=5")]
    [False, False, False, False, True, True]
    """
    return value is not None and value.strip().lower() not in OFF


def _warn(what: str, exc: BaseException) -> None:

    from weightsync_audit.errors import warn_user

    warn_user(
        f"weightsync audit: {ENV_VAR} is set but {what} ({type(exc).__name__}: {exc}); the Trainer is left "
        "without the audit: pass callbacks=WeightSyncAuditCallback.from_env() to it instead"
    )


def add_env_callback(trainer: Any) -> None:
    """Add ``WeightSyncAuditCallback.from_env()`` to a just-built ``trainer`` (what the wrapped ``__init__`` runs).

    Nothing when the variable is off now or the Trainer already holds a callback from ``from_env()``.
    A bad option raises ``ValueError`` naming it; any other failure warns and leaves the Trainer as it is.
    """
    if not is_on(os.environ.get(ENV_VAR)):
        return
    try:
        from weightsync_audit.integrations.hf.callback import WeightSyncAuditCallback

        present = list(trainer.callback_handler.callbacks)
    except Exception as exc:  # noqa: BLE001 - another transformers, a broken install: the Trainer stays as it is
        _warn("the Hugging Face callback could not be loaded or the Trainer's callbacks read", exc)
        return
    if any(isinstance(c, WeightSyncAuditCallback) and c.env_options is not None for c in present):
        return  # the user wrote callbacks=WeightSyncAuditCallback.from_env(): it is there already
    added = WeightSyncAuditCallback.from_env()  # a bad option: ValueError naming it, as under Lightning
    try:
        for callback in added:
            trainer.add_callback(callback)
    except Exception as exc:  # noqa: BLE001 - another transformers: the Trainer stays as it is
        _warn("the callback could not be added to the Trainer", exc)


def hook_trainer_module(module: Any) -> bool:
    """Wrap ``module.Trainer.__init__`` (once) so that it ends with :func:`add_env_callback`.

    Returns whether the class is wrapped; a module without a ``Trainer`` class warns and is left as it is.
    """
    try:
        import functools

        trainer_cls = module.Trainer
        init = trainer_cls.__init__
        if getattr(init, HOOKED, False):
            return True

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            add_env_callback(self)

        setattr(__init__, HOOKED, True)
        trainer_cls.__init__ = __init__
        return True
    except Exception as exc:  # noqa: BLE001 - a Trainer shaped differently: the module stays as it is
        _warn(f"{TARGET}.Trainer could not be hooked", exc)
        return False


class _HookingLoader:
    """The loader of ``transformers.trainer``, which hooks the module once it has run; every other call
    and attribute goes to the real loader (``get_source``, ``get_filename``, resource readers)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        hook_trainer_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class TrainerHook:
    """A ``sys.meta_path`` finder that answers only for ``transformers.trainer``: it asks the finders after
    it for the real spec and hands it back with a loader that hooks the ``Trainer`` once the module has run.
    For every other name it returns ``None`` at the cost of one comparison."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if isinstance(finder, TrainerHook) or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _HookingLoader(spec.loader)
            return spec
        except Exception as exc:  # noqa: BLE001 - the finders after this one are asked again by the import system
            _warn(f"{TARGET} could not be found through the hook", exc)
            return None


def install() -> None:
    """Put a :class:`TrainerHook` first on ``sys.meta_path`` (once) and hook ``transformers.trainer`` now
    if it is imported already. The ``.pth`` line calls it when the variable is on; calling it again adds
    nothing; never raises.

    Example (what the ``.pth`` line runs, for a process started without it)::

        from weightsync_audit.integrations.hf_activation import install
        install()
    """
    try:
        if not any(isinstance(f, TrainerHook) for f in sys.meta_path):
            sys.meta_path.insert(0, TrainerHook())
        module = sys.modules.get(TARGET)
        if module is not None:
            hook_trainer_module(module)
    except Exception as exc:  # noqa: BLE001 - never fail the interpreter's start-up
        _warn("the import hook could not be installed", exc)
