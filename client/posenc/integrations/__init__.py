"""posenc inside ML frameworks: transformers models, vLLM and SGLang rotary caches.

Each submodule imports its framework when it is imported, never before: ``import posenc``
and ``import posenc.integrations`` work without torch or transformers installed.

- :mod:`posenc.integrations.transformers`: :func:`~posenc.integrations.transformers.patch`,
  one call that makes a loaded transformers model use posenc's exact tables.
- :mod:`posenc.integrations.vllm`: the ``cos_sin_cache`` of vLLM's rotary embeddings.
- :mod:`posenc.integrations.sglang`: the same for SGLang's, kept exact as SGLang grows them.

Tensors need no integration: every table method of :class:`posenc.Client`,
:class:`posenc.AsyncClient` and :class:`posenc.GrowingTable` returns a ``torch.Tensor`` when
asked (``device=``, a torch ``dtype=``, a tensor ``out=`` or tensor positions), and
:meth:`posenc.Spec.from_config` reads a model's config.
"""
