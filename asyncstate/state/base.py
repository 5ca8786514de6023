"""InternalState: what every state object shares (name, kind, backend handle, requests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from asyncstate.runtime.requests import StateKind, StateRequestType

if TYPE_CHECKING:
    from asyncstate.runtime.controller import AsyncExecutionController
    from asyncstate.runtime.future import StateFuture
    from asyncstate.state.descriptors import StateDescriptor

__all__ = ["InternalState"]

_CLEAR: Final = StateRequestType.CLEAR  # compiled: Final alias


class InternalState:
    """A state bound to one operator: requests go through its controller to its backend."""

    __slots__ = ("_controller", "descriptor", "handle", "kind", "name")

    kind: StateKind

    def __init__(self, descriptor: StateDescriptor, controller: AsyncExecutionController,
                 handle: Any) -> None:
        self.descriptor = descriptor
        self.name = descriptor.name
        self.kind = descriptor.kind
        self.handle = handle
        self._controller = controller

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def clear(self) -> StateFuture[None]:
        """Remove this state's entry for the current key and namespace."""
        return self._controller.handle_request(self, _CLEAR, None)

    def set_current_namespace(self, namespace: Any) -> None:
        """Use `namespace` (a key-like value; None is the default) for this state's later
        calls in the current record."""
        self._controller.set_namespace(self, namespace)
