"""The format-free vLLM machinery every quantpack format plugs into (optional: ``pip install quantpack-core[vllm]``,
or a plugin's ``[cpu]`` / ``[cuda]`` extra that brings vLLM).

Only the plugins (quantpack-exl3, quantpack-escha-rocm, quantpack-families) import this subpackage; nothing else in
quantpack-core does, so quantpack-core alone imports no vLLM.

* :mod:`.config`: :class:`~.config.QuantpackConfig`, the base of a format's vLLM quantization config: the pack's
  manifest, which layer gets which method, the kernel lists of the platform;
* :mod:`.linear`: the per-shard linear method (placeholders and capture, shard plans, tensor-parallel cuts and
  fallbacks, the per-shard kernel choice, output assembly);
* :mod:`.moe`: the expert-bank method (per-expert capture, expert split, the bank's kernel);
* :mod:`.embedding`: int8-row (or dense) embeddings and tied heads;
* :mod:`.params`: the capturing placeholder parameters; :mod:`.layers`: the embedding / head constructor wrap;
  :mod:`.platform`: vLLM's platform as a :class:`~quantpack_core.kernels.Platform`; :mod:`.compat`: vLLM API drift.

A format supplies a :class:`~quantpack_core.format.LinearFormat` / :class:`~quantpack_core.format.ExpertFormat` and
its kernels' priority lists; see docs/architecture.md.
"""
