"""The callback for projects on the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

``lightning.pytorch`` and ``pytorch_lightning`` ship the same Trainer under two names, and each Trainer accepts only
its own package's ``Callback``. This module's :class:`MemoryTenantsCallback` is the package's callback, also a
``pytorch_lightning.Callback``: the same arguments, hooks, report and logged tags. Only this module imports
``pytorch_lightning``; the rest of the package runs without it.

Example::

    >>> import pytorch_lightning as pl
    >>> from lightning_memtenants.pl import MemoryTenantsCallback
    >>> trainer = pl.Trainer(callbacks=[MemoryTenantsCallback(budget_bytes="24GiB")])
"""

from __future__ import annotations

try:
    import pytorch_lightning
except ImportError as error:  # pragma: no cover - exercised in a process without the package
    raise ImportError(
        "lightning_memtenants.pl is the callback for pytorch_lightning.Trainer and needs the pytorch-lightning"
        " package (pip install pytorch-lightning); with the lightning package, use"
        " lightning_memtenants.MemoryTenantsCallback"
    ) from error

from lightning_memtenants.lightning.callback import MemoryTenantsCallback as _MemoryTenantsCallback

__all__ = ["MemoryTenantsCallback"]


class MemoryTenantsCallback(_MemoryTenantsCallback, pytorch_lightning.Callback):
    __doc__ = (
        (_MemoryTenantsCallback.__doc__ or "")
        .replace("from lightning.pytorch import Trainer", "from pytorch_lightning import Trainer")
        .replace(
            "from lightning_memtenants import MemoryTenantsCallback",
            "from lightning_memtenants.pl import MemoryTenantsCallback",
        )
    )
