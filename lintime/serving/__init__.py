"""Serving: many completion requests decoded together by one engine (continuous batching).

* :mod:`~lintime.serving.engine` -- :class:`Engine`: the loop thread that admits requests into slots,
  prefills their prompts in pieces between decoding steps, and steps every running request together;
* :mod:`~lintime.serving.slots` -- :class:`SlotStates`: the batch's decoding states in fixed buffers,
  one row per slot, stepped per power-of-two bucket of slots (the CUDA graph hook);
* :mod:`~lintime.serving.request` -- :class:`Request`, :class:`Event`, :class:`Handle` (the events of one
  request, blocking or asyncio), :class:`QueueFull`, :class:`EngineClosed`.

The HTTP layer (``lintime serve``) sits on top of :class:`Engine`.  See ``docs/design/decoding.md``.
"""

from lintime.serving.engine import Engine
from lintime.serving.request import EngineClosed, Event, Handle, QueueFull, Request
from lintime.serving.slots import SlotStates

__all__ = ["Engine", "EngineClosed", "Event", "Handle", "QueueFull", "Request", "SlotStates"]
