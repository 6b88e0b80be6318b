"""What this process and machine say, and what the launcher tells this rank: no world.

Imports only the standard library and ``errors``.

- ``env``: which launcher started this process (torchrun, Slurm, Open MPI, MPICH) and the
  package's knobs (``TENSORPLAY_TIMEOUT``, ``TENSORPLAY_PROGRESS_S``, ...);
- ``netif``: the address and interface this host reaches another from; a store's socket;
- ``procfs``: what /proc says of a process (state, children, command line, CPU time);
- ``wire``: the contract between tensorplay-run and its ranks (variables, the verdict and
  losses files, the report pipe, the ``Recovery`` record).
"""
