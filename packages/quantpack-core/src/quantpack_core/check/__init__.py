"""The pack check: plain rule functions over an opened pack, one module per concern, run in order by one runner
(:func:`problems`, :mod:`.runner`):

- :mod:`.files`: what could not be read, the shard files against the index and their headers, the manifest against
  the files, files the index omits, the tokenizer files;
- :mod:`.config`: config.json against itself and the tensors (method, bit counts, sizes, settings, layer counts);
- :mod:`.shapes`: stored shapes against the config's sizes;
- :mod:`.modules`: each module's storage, fused layers' kinds, stray tensors;
- :mod:`.moe`: expert banks as a whole;
- :mod:`.values`: values no trained model holds;
- :mod:`.layers` and :mod:`.architectures`: the decoder layers' layout, and the layers of the model classes the
  project states (one data module per architecture).

A format's own rules come from its plugin (:class:`quantpack_core.format.PackFormat`); no rule here names a format.
"""

from .runner import problems
from .settings import CheckSettings

__all__ = ["CheckSettings", "problems"]
