"""What the job's store costs on etcd against torch's TCPStore, measured in one run.

    python bench/etcd_store.py            # ~2 min on 2 cores
    python bench/etcd_store.py --quick    # 1,000 simulated launchers/ranks only

Needs the ``[ha]`` extra (the etcd3gw client and an etcd server binary). The etcd side is a
cluster of three members on 127.0.0.1, started as ``tensorplay-run --store etcd`` starts them
(``launcher/etcd_members.py``), so every write is replicated to a majority as in a job.

- **A (2, 4) mesh's groups**: 8 gloo ranks under ``tensorplay-run --nproc-per-node 8``, once
  with the default store and once with ``--store etcd``; each rank makes the mesh with every
  group at once (``TENSORPLAY_EAGER_GROUPS=1``) and a barrier on each dim; rank 0 prints the
  seconds (bench/etcd_store_job.py).
- **Leases**: N simulated launchers each hold a lease of TTL 10 s (the default --node-grace-s)
  renewed every 2 s (``liveness.keep_s(10)``), by 4 processes of 16 threads for 20 s (the
  members and the simulated launchers share this machine's cores); what counts
  is the longest any lease went without a renewal, and how many ran out (a renewal answered
  0 s): below the TTL, the cluster keeps them all alive. N = 1,000 and 10,000.
- **One agreement's store calls**: the calls of ``elastic/survivors.agree_lost`` for N
  survivors at their fewest: each posts its ``here/<rank>`` (N calls), each checks that all
  have posted (N checks of N keys: one call each on both stores; 200 of them timed and the
  total scaled to N, as each reads N names: 10^8 at 10,000), one decides
  (``compare_set``), each reads the verdict (N calls): 3N + 1 calls, driven by a pool of 16
  threads with a client each, on etcd and on a TCPStore. It is the protocol's store traffic,
  not ``agree_lost`` itself (whose polling adds more), so it is a floor: at 100,000 ranks the
  same 3N + 1 calls are what one recovery puts on the store.

Results: printed, and written to bench/results/etcd_store.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta

from _common import BENCH, ROOT, fmt_time, machine, pythonpath, tree_state
from _results import add_out, recorded

from tensorplay.distributed.backends import etcd
from tensorplay.distributed.launcher import etcd_members
from tests import spawn

THREADS = 16
PROCS = 4  # processes of simulated launchers (one Python client does ~480 calls/s here)
CHECKS_SAMPLED = 200  # of the N checks of N keys, this many are timed and the rest scaled
TTL_S, KEEP_S, HOLD_S = 10, 2.0, 20.0


class Cluster:
    """Three members on 127.0.0.1, as the launchers start them; stopped on the way out."""

    def __enter__(self) -> Cluster:
        port = spawn.free_ports(6)
        self.seats = [etcd_members.seat(k, "127.0.0.1", port, "bench") for k in range(3)]
        self.members = [etcd_members.LocalMember.start_new(self.seats[0], 60)]
        try:
            for k in (1, 2):
                via = etcd.Etcd([s.endpoint for s in self.seats[:k]], 10)
                self.members.append(etcd_members.LocalMember.join(self.seats[k], via, 60))
        except BaseException:
            self.__exit__()
            raise
        self.endpoints = [s.endpoint for s in self.seats]
        return self

    def client(self, prefix: str = "") -> etcd.Etcd:
        return etcd.Etcd(self.endpoints, 10.0, prefix)

    def __exit__(self, *exc: object) -> None:
        for member in self.members:
            member.stop(10)


# ---------------------------------------------------------------- a (2, 4) mesh's groups

def mesh_groups(store: str) -> float | None:
    """Seconds for rank 0 to make the (2, 4) mesh's groups under ``--store store``."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TENSORPLAY_EAGER_GROUPS": "1"}
    argv = [sys.executable, "-m", "tensorplay.distributed.run", "--store", store,
            "--nproc-per-node", "8", os.path.join(BENCH, "etcd_store_job.py")]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                         cwd=ROOT).stdout
    for line in out.splitlines():
        if "mesh groups made in" in line:
            return float(line.split("mesh groups made in")[1].split()[0])
    print(out[-2000:], file=sys.stderr)
    return None


# ---------------------------------------------------------------- leases

def leases(cluster: Cluster, n: int) -> dict:
    """N leases renewed every KEEP_S for HOLD_S by PROCS processes of THREADS threads (see the
    module): the simulated launchers' side is not what runs out first."""
    with ProcessPoolExecutor(PROCS) as pool:
        parts = list(pool.map(_hold_leases, [cluster.endpoints] * PROCS,
                              [n // PROCS + (i < n % PROCS) for i in range(PROCS)]))
    return {"n": n, "granted_s": max(r["granted_s"] for r in parts),
            "rate": sum(r["rate"] for r in parts), "wanted": n / KEEP_S,
            "max_gap": max(r["max_gap"] for r in parts), "lost": sum(r["lost"] for r in parts)}


def _hold_leases(endpoints: list[str], n: int) -> dict:
    """One process's share of ``leases``."""
    local = threading.local()

    def client() -> etcd.Etcd:
        if not hasattr(local, "etcd"):
            local.etcd = etcd.Etcd(endpoints, 10.0, "bench-leases/")
        return local.etcd

    with ThreadPoolExecutor(THREADS) as pool:
        began = time.monotonic()
        ids = list(pool.map(lambda _: client().lease(TTL_S), range(n)))
        granted_s = time.monotonic() - began
        last = {lease: time.monotonic() for lease in ids}
        gaps = dict.fromkeys(ids, 0.0)
        lost: set[int] = set()
        calls = 0
        start = time.monotonic()
        end = start + HOLD_S
        while time.monotonic() < end:
            round_began = time.monotonic()

            def renew(lease: int) -> int:
                ttl = client().keepalive(lease)
                now = time.monotonic()
                gaps[lease] = max(gaps[lease], now - last[lease])
                last[lease] = now
                return ttl

            answers = list(pool.map(renew, ids))
            calls += len(ids)
            lost |= {lease for lease, ttl in zip(ids, answers, strict=True) if ttl <= 0}
            time.sleep(max(KEEP_S - (time.monotonic() - round_began), 0.0))
        held_s = time.monotonic() - start
        list(pool.map(lambda lease: client().revoke(lease), ids))
    return {"granted_s": granted_s, "rate": calls / held_s, "max_gap": max(gaps.values()),
            "lost": len(lost)}


# ---------------------------------------------------------------- one agreement

def agreement(make_client, n: int) -> dict:
    """3N + 1 store calls of one agreement of N survivors (see the module)."""
    local = threading.local()

    def client():
        if not hasattr(local, "store"):
            local.store = make_client()
        return local.store

    here = [f"here/{r}" for r in range(n)]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda _: client(), range(THREADS)))  # connected before the clock
        began = time.monotonic()
        list(pool.map(lambda r: client().set(here[r], "[]"), range(n)))
        posted = time.monotonic()
        sample = min(n, CHECKS_SAMPLED)
        assert all(pool.map(lambda _: client().check(here), range(sample)))
        checked = time.monotonic()
        check_s = (checked - posted) * n / sample  # N checks of N keys: O(N^2) names read
        client().compare_set("verdict", "", "lost=[]")
        list(pool.map(lambda _: client().get("verdict"), range(n)))
        done = time.monotonic()
    return {"n": n, "calls": 3 * n + 1, "post": posted - began, "check": check_s,
            "sampled": sample, "read": done - checked,
            "total": posted - began + check_s + done - checked}


def _tcp_clients(n_keys: int):
    import torch.distributed as dist

    port = spawn.free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    prefix = f"agree-{n_keys}/"
    return server, (lambda: dist.PrefixStore(prefix, dist.TCPStore(
        "127.0.0.1", port, None, False, timeout=timedelta(seconds=60))))


# ---------------------------------------------------------------- report

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1,000 only (not 10,000)")
    add_out(p, __file__)
    a = p.parse_args(argv)
    if etcd.missing_client():
        sys.exit(f"etcd_store: {etcd.missing_client()}")
    sizes = (1000,) if a.quick else (1000, 10000)
    with recorded(__file__, a.out):
        began = time.monotonic()
        print(f"etcd_store: tensorplay at {tree_state()}; {machine()}; "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
        shown = argv if argv is not None else sys.argv[1:]
        print(f"command: {' '.join(['python', 'bench/etcd_store.py', *shown])}", flush=True)
        tmp = tempfile.mkdtemp(prefix="etcd-store-bench-")
        tempfile.tempdir = tmp  # the members' data under it, removed at the end
        try:
            tcp_s, etcd_s = mesh_groups("tcp"), mesh_groups("etcd")
            with Cluster() as cluster:
                held = [leases(cluster, n) for n in sizes]
                agreed = []
                for n in sizes:
                    server, tcp_client = _tcp_clients(n)
                    agreed.append(("TCPStore (one server)", agreement(tcp_client, n)))
                    del server
                    agreed.append(("etcd (3 members)", agreement(
                        lambda n=n: cluster.client(f"agree-{n}/"), n)))
        finally:
            tempfile.tempdir = None
            shutil.rmtree(tmp, ignore_errors=True)

        print("\n### A (2, 4) mesh's groups, 8 gloo ranks on one host (rank 0's seconds)\n")
        print("| store | mesh with every group, and a barrier per dim |")
        print("|---|---:|")
        for name, s in (("default (node 0's TCPStore)", tcp_s), ("--store etcd", etcd_s)):
            print(f"| {name} | {'-' if s is None else fmt_time(s)} |")
        if tcp_s and etcd_s:
            print(f"\netcd / TCPStore: {etcd_s / tcp_s:.1f}x")

        print(f"\n### Leases: TTL {TTL_S} s renewed every {KEEP_S:g} s for {HOLD_S:g} s, "
              f"{PROCS} processes x {THREADS} threads, a 3-member cluster\n")
        print("| launchers | granted in | renewals/s wanted | renewals/s done | longest gap "
              "without a renewal | leases that ran out |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in held:
            print(f"| {r['n']:,} | {fmt_time(r['granted_s'])} | {r['wanted']:,.0f} | "
                  f"{r['rate']:,.0f} | {fmt_time(r['max_gap'])} | {r['lost']} |")

        print(f"\n### One agreement's store calls at their fewest (3N + 1), {THREADS} "
              f"threads\n")
        print("| survivors N | store | calls | posts | checks (scaled from 200) | verdict "
              "reads | total |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for name, r in agreed:
            print(f"| {r['n']:,} | {name} | {r['calls']:,} | {fmt_time(r['post'])} | "
                  f"{fmt_time(r['check'])} | {fmt_time(r['read'])} | {fmt_time(r['total'])} |")
        kept = all(r["max_gap"] < TTL_S and not r["lost"] for r in held)
        counts = ", ".join(f"{r['n']:,}" for r in held)
        print(f"\n```\nLeases kept alive (longest gap < TTL, none ran out) at {counts} "
              f"launchers: {'YES' if kept else 'NO'}\n```")
        print(f"\nwall time of this run: {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
