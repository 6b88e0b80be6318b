"""Train a tiny mixture-of-experts model on 8 ranks cut two ways: a dense view and an expert view.

Run it with 8 processes; any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
works, so either of

    tensorplay-run --nproc-per-node 8 examples/train_moe.py
    torchrun --nproc-per-node 8 examples/train_moe.py

The model, on 64 tokens of 8 features: h = tanh(x @ W_in); a gate (h @ W_gate, softmax) sends
each token to its top-2 of 4 experts, expert e computing relu(h @ A_e) @ B_e; the two answers,
weighted by the gate's renormalised probabilities, are added to h; y = (h + moe) @ W_out.

The same 8 ranks, two views (``mesh.reshape``):

- dense (dp_replicate=2, dp_shard=4) = [[0, 1, 2, 3], [4, 5, 6, 7]]: each rank trains on its 8
  tokens (rank r: tokens 8r .. 8r+7); W_in, W_gate, W_out (128 numbers, flat) are sharded over
  "dp_shard" (32 each), gathered for the step, and their gradients reduce-scattered back;
- expert (dp_replicate=2, efsdp=2, ep=2) = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]: experts 0-1
  live on the ranks at ep=0, experts 2-3 at ep=1; a rank's two experts (512 numbers) are sharded
  over "efsdp" (256 each). Tokens go to their experts' "ep" rank and come back by all-to-all.

Where the two views' groups have the same ranks they are the same group objects: "dp_replicate"
([0, 4] on rank 0), and "efsdp" x "ep" flattened is dense's "dp_shard" ([0, 1, 2, 3]); the view
makes new groups only for "efsdp" ([0, 2]) and "ep" ([0, 1]). Rank 0 prints this.

Gradients: the loss is the mean over all 64 tokens = the mean of the 8 ranks' local losses, so a
parameter's gradient is the sum of every rank's local gradient divided by 8. The dense weights
are gathered on all 8 ranks, so that is the average of the 8 ranks' gradients. An expert is
gathered on only 4 ranks (dp_replicate x efsdp), and each of them already holds the sum over the
2 "ep" ranks whose tokens it served (the backward all-to-all brings them), so its gradient is the
sum over its 4 ranks divided by 8, not their average (2x too large; ``--average-expert-grads``
makes that mistake on purpose).

Rank 0 prints the views, how many rows its first step sends to each "ep" rank ([9, 7]), the loss
of each step, after the first the communicators it holds (the view's "efsdp" and "ep" groups are
made by that step, at their first use) and the time since it began to join, and how far the
final weights and losses are from the same training in one process (float64); above 1e-6 every
rank exits 1. The loss goes 1.253471 -> 0.373239 over 5 steps, as in one process, and it prints
"max abs diff: 2.220e-16".
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

import tensorplay.distributed as dist
from tensorplay.distributed.device_mesh import init_device_mesh

D_IN, D, D_OUT = 8, 8, 4  # features in, model width, outputs
EXPERTS, HIDDEN, TOP_K = 4, 16, 2  # experts, hidden units per expert, experts per token
TOKENS = 64  # the global batch, 8 tokens per rank
LR, SEED, TOLERANCE = 0.5, 0, 1e-6
DTYPE = torch.float64  # float64 keeps the 1e-6 check far above rounding noise
STARTED = time.monotonic()  # reset in main(), just before init_process_group


def parse_args() -> argparse.Namespace:
    """The command line: --steps, and a switch that breaks training on purpose."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    p.add_argument("--average-expert-grads", action="store_true",
                   help="for tests only: average the expert gradients over the ranks holding "
                        "them, as for the dense weights: 2x too large, so the check must fail")
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    return a


# -- the model, in plain torch ------------------------------------------------------------------
def make_problem() -> dict[str, torch.Tensor]:
    """Initial weights and the (inputs, targets) batch; the same on every rank (same seed)."""
    gen = torch.Generator().manual_seed(SEED)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    p = {"w_in": randn(D_IN, D) / D_IN**0.5, "w_gate": randn(D, EXPERTS),
         "w_out": randn(D, D_OUT) / D**0.5,
         "a": randn(EXPERTS, D, HIDDEN) / D**0.5, "b": randn(EXPERTS, HIDDEN, D) / HIDDEN**0.5}
    teacher = randn(D_IN, D_OUT)  # the function the model learns: tanh(x @ teacher)
    p["x"] = randn(TOKENS, D_IN)
    p["target"] = torch.tanh(p["x"] @ teacher)
    return p


def route(h: torch.Tensor, w_gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's TOP_K experts (n, TOP_K) and their weights: the gate's probabilities of
    those experts, renormalised to sum to 1."""
    probs = torch.softmax(h @ w_gate, dim=-1)
    weights, ids = probs.topk(TOP_K, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def expert(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One expert: a small MLP on the tokens sent to it."""
    return torch.relu(h @ a) @ b


def reference(problem: dict[str, torch.Tensor], steps: int):
    """The same training in one process: every expert, the full batch, autograd, plain SGD.
    Returns the final weights and each step's loss."""
    w = {k: problem[k].clone().requires_grad_() for k in ("w_in", "w_gate", "w_out", "a", "b")}
    x, target = problem["x"], problem["target"]
    losses = []
    for _ in range(steps):
        h = torch.tanh(x @ w["w_in"])
        ids, weights = route(h, w["w_gate"])
        moe = torch.zeros_like(h)
        for e in range(EXPERTS):
            token, slot = (ids == e).nonzero(as_tuple=True)  # who chose e, as which choice
            out = expert(h[token], w["a"][e], w["b"][e]) * weights[token, slot, None]
            moe = moe.index_add(0, token, out)
        loss = ((((h + moe) @ w["w_out"]) - target) ** 2).mean()
        grads = torch.autograd.grad(loss, list(w.values()))
        with torch.no_grad():
            for t, g in zip(w.values(), grads, strict=True):
                t -= LR * g
        losses.append(loss.item())
    return {k: t.detach() for k, t in w.items()}, losses


# -- moving tokens: all-to-all with autograd ----------------------------------------------------
class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group``: ``send[i]`` rows to group rank i, ``recv[i]``
    rows from it. The backward pass sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def moe_layer(h, ids, weights, a, b, ep_group):
    """The expert layer on this rank's tokens, its experts being ``a``, ``b`` (local ones);
    returns the output and the rows sent to and received from each "ep" rank.

    With 2 "ep" ranks and 4 experts, ep rank j holds experts 2j and 2j+1. Each (token, choice)
    pair is a row; rows are sorted by expert, so the rows for ep rank j come j-th. The 4 counts
    of rows per expert go first (an all-to-all: ep rank j gets the 2 counts of its experts), so
    that each rank knows how many rows it receives from whom and for which of its experts.
    """
    n_ep, n_local = ep_group.size(), a.shape[0]
    expert_of = ids.reshape(-1)  # row t * TOP_K + k: token t's k-th choice
    order = torch.argsort(expert_of, stable=True)
    token = order // TOP_K  # the token of each sorted row
    counts = torch.bincount(expert_of, minlength=EXPERTS)  # rows per expert, from this rank
    recv_counts = torch.empty_like(counts)  # [source][my local expert]: rows I receive
    dist.all_to_all_single(recv_counts, counts, group=ep_group)
    send = counts.view(n_ep, n_local).sum(dim=1).tolist()
    recv = recv_counts.view(n_ep, n_local).sum(dim=1).tolist()
    rows = AllToAll.apply(h[token], send, recv, ep_group)  # my experts' rows, by source
    local = torch.arange(n_local).repeat(n_ep).repeat_interleave(recv_counts)  # row's expert
    out = torch.zeros_like(rows)
    for e in range(n_local):
        mine = (local == e).nonzero(as_tuple=True)[0]
        out = out.index_add(0, mine, expert(rows[mine], a[e], b[e]))
    back = AllToAll.apply(out, recv, send, ep_group)  # answers home, in sorted-row order
    back = back * weights.reshape(-1)[order, None]
    return torch.zeros_like(h).index_add(0, token, back), send, recv


# -- sharded flat weights (a minimal FSDP) ------------------------------------------------------
def my_shard(flat: torch.Tensor, group) -> torch.Tensor:
    """This rank's piece of a flat weight vector split evenly over ``group``."""
    return flat.chunk(group.size())[dist.get_rank(group)].clone()


def gather(shard: torch.Tensor, group) -> torch.Tensor:
    """The whole flat vector from every member's shard."""
    full = shard.new_empty(shard.numel() * group.size())
    dist.all_gather_into_tensor(full, shard, group=group)
    return full


def reduce_grad(grad: torch.Tensor, shard_group, replicate_group, divisor: int) -> torch.Tensor:
    """This rank's shard of the summed gradient: summed over the shard group (reduce-scatter)
    and over the replicas (all-reduce), divided by ``divisor``."""
    shard = grad.new_empty(grad.numel() // shard_group.size())
    dist.reduce_scatter_tensor(shard, grad, op=dist.ReduceOp.SUM, group=shard_group)
    dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=replicate_group)
    return shard / divisor


def unflat(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes, one after another."""
    sizes = [torch.Size(s).numel() for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]


DENSE_SHAPES = [(D_IN, D), (D, EXPERTS), (D, D_OUT)]  # w_in, w_gate, w_out


def expert_shapes(n_local: int) -> list[tuple[int, ...]]:
    """The shapes of a rank's A and B: its ``n_local`` experts' weights."""
    return [(n_local, D, HIDDEN), (n_local, HIDDEN, D)]


def train(dense, expert_view, problem, steps: int, average_expert_grads: bool, say):
    """SGD on this rank's shards and tokens; returns the final shards."""
    dp_shard, dp_rep = dense.get_group("dp_shard"), dense.get_group("dp_replicate")
    efsdp, ep = expert_view.get_group("efsdp"), expert_view.get_group("ep")
    n_local = EXPERTS // ep.size()
    first = dist.get_rank(ep) * n_local  # my first expert
    dense_shard = my_shard(torch.cat([problem[k].flatten() for k in ("w_in", "w_gate", "w_out")]),
                           dp_shard)
    expert_shard = my_shard(torch.cat([problem[k][first:first + n_local].flatten()
                                       for k in ("a", "b")]), efsdp)
    i = dense.get_local_rank("dp_replicate") * dense.size(1) + dense.get_local_rank("dp_shard")
    per_rank = TOKENS // dense.size()
    x, target = (problem[k][i * per_rank:(i + 1) * per_rank] for k in ("x", "target"))
    world = dense.size()  # the number of batch shards: the loss is their mean
    gathered_on = dp_rep.size() * efsdp.size()  # the ranks an expert is gathered on
    losses = []
    for step in range(steps):
        dense_full = gather(dense_shard, dp_shard).requires_grad_()
        expert_full = gather(expert_shard, efsdp).requires_grad_()
        w_in, w_gate, w_out = unflat(dense_full, DENSE_SHAPES)
        a, b = unflat(expert_full, expert_shapes(n_local))
        h = torch.tanh(x @ w_in)
        ids, weights = route(h, w_gate)
        moe, send, recv = moe_layer(h, ids, weights, a, b, ep)
        if step == 0:
            say(f"step 1: rank 0 sends {send} (token, expert) rows to ep ranks {ep.ranks} "
                f"and receives {recv}")
        y = (h + moe) @ w_out
        loss = ((y - target) ** 2).mean()  # this rank's tokens only
        dense_grad, expert_grad = torch.autograd.grad(loss, [dense_full, expert_full])
        dense_shard -= LR * reduce_grad(dense_grad, dp_shard, dp_rep, world)
        expert_shard -= LR * reduce_grad(expert_grad, efsdp, dp_rep,
                                         gathered_on if average_expert_grads else world)
        total = loss.detach().reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the mean over all 64 tokens
        losses.append(total.item())
        say(f"step {step + 1}/{steps}  loss {total.item():.6f}")
        if step == 0:  # what the first step cost: its communicators and its time
            say(expert_view.describe().rsplit("\n\n", 1)[-1])
            say(f"first step done {time.monotonic() - STARTED:.2f} s after the process began "
                "to join the world")
    return dense_shard, expert_shard, losses


def compare(dense, expert_view, shards, problem, steps: int, say) -> bool:
    """Whether every rank's weights and the losses are within TOLERANCE of one process's
    training (every rank checks its own; the worst is all-reduced)."""
    dense_shard, expert_shard, losses = shards
    ref, ref_losses = reference(problem, steps)
    w_in, w_gate, w_out = unflat(gather(dense_shard, dense.get_group("dp_shard")), DENSE_SHAPES)
    n_local = EXPERTS // expert_view.size(2)
    first = expert_view.get_local_rank("ep") * n_local
    a, b = unflat(gather(expert_shard, expert_view.get_group("efsdp")), expert_shapes(n_local))
    pairs = [(w_in, ref["w_in"]), (w_gate, ref["w_gate"]), (w_out, ref["w_out"]),
             (a, ref["a"][first:first + n_local]), (b, ref["b"][first:first + n_local]),
             (torch.tensor(losses, dtype=DTYPE), torch.tensor(ref_losses, dtype=DTYPE))]
    diff = max((mine - want).abs().max() for mine, want in pairs).reshape(1)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    worst = diff.item()
    say(f"one process: loss {ref_losses[0]:.6f} -> {ref_losses[-1]:.6f}")
    say(f"max abs diff: {worst:.3e} (tolerance {TOLERANCE:g}; weights and losses, all ranks)")
    say("OK: matches single-process training" if worst <= TOLERANCE else
        f"MISMATCH: trained weights differ from single-process training by {worst:.3e}")
    return worst <= TOLERANCE


def show_views(dense, expert_view, say) -> None:
    """Rank 0 prints both views and which of the expert view's groups are dense's."""
    efsdp_ep = expert_view["efsdp", "ep"].flatten("efsdp_ep")  # finds dense's "dp_shard" group
    say(f"dense  {dense}")
    say(f"expert {expert_view}")
    say(f"{'rank ' + str(dist.get_rank()) + ':':<8} {'expert dim':<13} {'group':<13} is")
    for name, group in [*((n, expert_view.get_group(n)) for n in expert_view.mesh_dim_names),
                        ("efsdp x ep", efsdp_ep.get_group())]:
        same = [n for n in dense.mesh_dim_names if dense.get_group(n) is group]
        say(f"{'':<8} {name:<13} {str(group.ranks):<13} "
            f"{'dense ' + repr(same[0]) + ' (the same group)' if same else 'new'}")


def main() -> int:
    """Set up the world and both views, train, check; the exit code is 1 on a mismatch."""
    global STARTED
    a = parse_args()
    STARTED = time.monotonic()
    dist.init_process_group()  # the launcher's RANK, WORLD_SIZE, ... (env://), gloo on CPU
    # The dense view: 2 replicas x 4 shards. Its roles say what each dim does.
    dense = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"),
                             mesh_dim_roles={"dp_replicate": "replicate", "dp_shard": "shard"})
    # The expert view: the same ranks, dp_shard's 4 cut into efsdp=2 x ep=2 (row-major, as
    # numpy's dense.mesh.reshape(2, 2, 2)); shared= checks that dp_replicate keeps its groups.
    expert_view = dense.reshape((2, 2, 2), ("dp_replicate", "efsdp", "ep"),
                                shared=("dp_replicate",),
                                mesh_dim_roles={"efsdp": "shard", "ep": "expert"})
    rank = dist.get_rank()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    show_views(dense, expert_view, say)
    problem = make_problem()
    shards = train(dense, expert_view, problem, a.steps, a.average_expert_grads, say)
    ok = compare(dense, expert_view, shards, problem, a.steps, say)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
