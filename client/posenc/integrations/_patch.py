"""What the model patches of the transformers and diffusers integrations share.

A patch replaces attributes of a model's modules (methods shadowed by instance attributes,
buffers swapped for posenc's) and remembers how to put each back: :meth:`Patched.undo`
restores them last first, and leaving a ``with`` block undoes the patch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import posenc


class Patched:
    """The changes a ``patch`` made to a model, undoable.

    Attributes:
        specs: The spec of each replaced table, by module name.
        skipped: The modules left as they are, by name, each with the reason.
    """

    def __init__(self, client: posenc.Client) -> None:
        self.client = client
        self.specs: dict[str, posenc.Spec] = {}
        self.skipped: dict[str, str] = {}
        self._undo: list[Callable[[], None]] = []

    def undo(self) -> None:
        """Restores every patched module as it was (its own tables and methods)."""
        while self._undo:
            self._undo.pop()()
        self._forget()

    def _forget(self) -> None:
        """Drops what the patch fetched, once undone (nothing here)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()  # on an error too: the model is left as it was

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.specs) or 'nothing'})"

    def _override(self, module: Any, name: str, value: Any) -> None:
        """Sets an instance attribute (e.g. ``forward``) that shadows the class's."""
        object.__setattr__(module, name, value)
        self._undo.append(lambda: module.__dict__.pop(name, None))

    def _replace(self, module: Any, name: str, value: Any) -> None:
        """Replaces a buffer, parameter or plain attribute, restoring the original on undo."""
        original = getattr(module, name)
        setattr(module, name, value)
        self._undo.append(lambda: setattr(module, name, original))
