"""Built-in pipeline stages. Importing this package registers them.

One file per stage, each with its ``Config`` beside it:

- validate: ``batch_checks``     - plan: ``dual_chunk_swap``
- buffers: ``persistent``        - slots: ``paged``
- forward: ``model``             - restore: ``all_rows``, ``sampled_rows``
- draft: ``none``, ``mtp``, ``dspark``, ``self``
"""

from stages import buffers, draft_none, dspark, forward, mtp, plan, restore, self_draft, slots, validate  # noqa: F401,E501
