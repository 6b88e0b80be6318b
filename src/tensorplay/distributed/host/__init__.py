"""What this process and machine say, and what the launcher tells this rank: no world.

Imports only the standard library and ``errors``.

- ``launchers``: which launcher started this process (torchrun, Slurm, Open MPI, MPICH) and
  what its variables say (rank, size, local place, rank 0's address);
- ``knobs``: the package's own settings (``TENSORPLAY_TIMEOUT``, ``TENSORPLAY_PROGRESS_S``,
  ``TENSORPLAY_STRICT``, ``TENSORPLAY_EAGER_GROUPS``, ``TENSORPLAY_HOSTNAME``);
- ``netif``: the address and interface this host reaches another from; a store's socket;
- ``procfs``: what /proc says of a process (state, children, command line, CPU time);
- ``wire``: the contract between tensorplay-run and its ranks (variables, the verdict and
  losses files, the report pipe, the ``Recovery`` record).
"""
