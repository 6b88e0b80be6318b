"""The launcher ``tensorplay-run``: starts and supervises this node's ranks of one job.

One module, one job (docs/architecture.md has the table):

- ``options``: the command line's flags and checks; ``spec``: the frozen ``LaunchSpec`` built
  once from them, and each rank's environment (``child_env``);
- ``events``: the typed events the supervising thread takes off one queue;
- ``output``: the ranks' output (labelled, filtered, logged; tracebacks held and printed once);
- ``procs``: start, signal, stop and reap the ranks' process groups;
- ``job``: one supervise loop with two policies (``FailFast``, ``RestartLost``), one conclusion;
- ``hangs``: ranks alive but stuck;
- ``nodes``: the launchers of one job across nodes (``JobNodes``), tying ``join`` (they meet
  and check they agree), ``heartbeat`` (they watch each other), ``verdicts`` (the one reason
  the job stops) and ``roster`` (who holds which node; elastic news of nodes lost and back);
- ``links``: one connection per launcher to node 0's, so a launcher that dies is seen at once;
- ``store``: the launcher's store behind a small interface (torch's TCPStore, loaded lazily),
  and the one classifier of its failures (``StoreGone``);
- ``bugs``: a bug in a launcher thread said once on stderr, and handed on to fail the job;
- ``rank_main``: what runs in each rank (loaded by path: it imports nothing of the package);
- ``warm``: warm start: one process imports torch once and forks each rank (``--no-warm``);
- ``rank_ends``: how each rank ended (``RankReport``, ``RankEnd``) -> the one summary line;
- ``rank_table``: the rank -> pid table of a running job (a file; ``tensorplay-run --ps``);
- ``handoff``: without torch, the job run under ``mpiexec`` (the MPI engine), or the line to use;
- ``main``: the entry point (``tensorplay-run``, ``python -m tensorplay.distributed.run``).

Importing the package loads none of them: ``from tensorplay.distributed.launcher.main import
main``.
"""
