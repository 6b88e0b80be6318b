"""The control plane: what the ranks of one world decide together, declared once.

Every cross-rank protocol (the argument check, the call accounting, the elastic chain)
speaks the verbs of ``plane.Control`` and the marks of ``plane.Board``; ``store`` and
``gather`` are the two ways to run them (over the job's store, over the engine's all-gather).

- ``plane``: the ``Control`` verbs and the ``Board`` capability;
- ``keys``: every store key of the ranks and the SPMD counters;
- ``store``, ``gather``: the control plane over a store, over an all-gather (MPI), or solo;
- ``arrivals``: barrier arrival marks; ``consensus``: ``agree()``; ``accounting``: call
  counts compared; ``strict``: each call's fingerprint checked across its group.
"""
