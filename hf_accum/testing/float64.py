"""Float64 without float32 islands, for any architecture: :func:`float64_arithmetic`.

Many transformers modules compute part of their forward in float32 on purpose, whatever the model's
dtype: RMSNorm/LayerNorm variants (``hidden_states.to(torch.float32)``, ``x.float()``), rotary
embeddings, the eager attention's ``softmax(..., dtype=torch.float32)``, MoE routers. In a float64
exactness check those islands put a ~1e-7..1e-9 rounding floor under every comparison and hide what
the check measures (how gradients are accumulated and normalized), and a list of classes to patch is
never complete. So instead of patching modules, the request itself is rewritten: while the context is
active, a torch function mode turns every float32 request -- ``Tensor.float()``, ``.to(torch.float32)``,
``.type(torch.float32)``, any ``dtype=torch.float32`` argument (softmax, factories) -- into float64, and
the default dtype is float64. Nothing else changes: the model runs its own code, in float64 throughout.
bf16/fp16 requests are left alone (a float64 check holds none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CASTS = (torch.Tensor.to, torch.Tensor.type)


class _Float64Requests(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:  # torch's protocol: any op, any result
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func in _CASTS:
            args = tuple(torch.float64 if arg is torch.float32 else arg for arg in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_arithmetic() -> Iterator[None]:
    """Within the context, float32 requests compute in float64 (see the module docstring)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Requests():
            yield
    finally:
        torch.set_default_dtype(previous)
