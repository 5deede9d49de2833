"""``lintime train --compile``: the model compiled as one graph where it traces, else with graph breaks.

Which families trace in one graph depends on the device: on CUDA the ops' Triton paths are opaque custom ops, on
the CPU some chunked PyTorch forms read ``cu_seqlens`` on the host (docs/models.md, "Compiling").  Rather than a
table that could drift, the first call tries ``fullgraph=True`` and falls back once, with a one-line notice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile(fullgraph=True)``; if its first call cannot trace as one graph, compiled
    again with graph breaks (``say`` gets one line).  Attributes other than ``forward`` are the module's;
    ``backend`` is ``torch.compile``'s (tests use ``"aot_eager"``)."""

    def __init__(self, module: nn.Module, say: Callable[[str], None], what: str = "the model", *,
                 backend: str = "inductor"):
        super().__init__()
        self.module = module
        # not a submodule: its parameters are the module's
        compiled = torch.compile(module, fullgraph=True, backend=backend)
        self.__dict__.update(_compiled=compiled, _say=say, _what=what, _backend=backend, _tried=False)
        self.fullgraph = True

    def forward(self, *args, **kwargs):
        if self._tried:
            return self._compiled(*args, **kwargs)
        try:
            out = self._compiled(*args, **kwargs)  # dynamo traces before anything runs: a failure has no effects
        except torch._dynamo.exc.TorchDynamoException as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self._say(f"lintime train: --compile: {self._what} does not trace as one graph ({reason}); "
                      f"compiling it with graph breaks")
            self.__dict__["_compiled"] = torch.compile(self.module, backend=self._backend)
            self.fullgraph = False
            out = self._compiled(*args, **kwargs)
        self._tried = True
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)
