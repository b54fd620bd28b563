"""Module buffers that keep their dtype when the module is cast to another precision."""

from __future__ import annotations


class KeepsExactTensors:
    """Moving the module to another device moves these buffers too, but casting the module to
    another dtype leaves them as they are: 8-bit weights and fp32 scales are the checkpoint's
    numbers, which a `.half()` would round."""

    exact: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.exact}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            setattr(self, name, tensor.to(getattr(self, name).device))
        return self
