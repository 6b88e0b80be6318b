"""One joined world: the ``World`` object, how it starts and ends, and how its failures read.

- ``world``: ``World`` (rank, size, engine, store, control plane, the epoch's groups);
- ``lifecycle``: ``init_process_group``/``destroy_process_group`` and ``current_world``;
- ``context``: the read-only view of a World the cross-rank helpers take;
- ``registry``: one epoch's groups by (ordered ranks, backend);
- ``failures``: engine and store failures worded as our errors;
- ``watch``: what a waiting rank watches (this host's ranks, the launcher's verdict, the
  failed marks);
- ``progress``: what a long call waits in, said once.
"""
