"""Built-in pipeline stages, installed as ``pcpflow.stages``; ``pcpflow.pipeline.assemble.BUILTIN_STAGES``
lists the modules it imports (their ``@register`` calls fill the registry).

One file per stage, each with its ``Config`` beside it:

- validate: ``batch_checks``     - plan: ``dual_chunk_swap``
- buffers: ``persistent``        - slots: ``paged``
- forward: ``model``             - restore: ``all_rows``, ``sampled_rows``
- draft: ``none``, ``mtp``, ``dspark``, ``self``
"""
