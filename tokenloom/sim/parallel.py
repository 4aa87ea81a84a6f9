"""Step time under tensor and pipeline parallelism: the compute split plus the communication the
sharded model does (docs/parallelism.md has the model, its parameters and its projections).

One step of a Llama-style model under TP = N, PP = M (tokenloom's cut, tokenloom/model/tp_shard.py):

* compute: the one-rank step time `compute_s` split N x M ways. On a CPU a decode step streams the
  weights (memory-bound), so a rank that holds 1 / (N M) of them reads 1 / (N M) of the bytes; a
  prefill-heavy step is FLOP-bound and splits the same way. `efficiency` (<= 1) discounts what does
  not split (attention over the whole context per head is split too; norms, sampling and the
  engine's host work are not).
* TP: 2 all-reduces per decoder layer (o_proj, down_proj) plus one for the vocab-parallel embedding,
  each of `tokens x hidden x act_bytes`, and one all-gather of the logits. An all-reduce costs
  `Link.allreduce_s`: a ring, 2 (N - 1) messages of bytes / N each, each `latency_s + bytes /
  bandwidth` (the textbook bound; vLLM's and SGLang's shared-memory all-reduce on one node has the
  same shape with a few-microsecond latency).
* PP: the M stages run one after another for one batch (M - 1 sends of `tokens x 2 hidden` between
  them: hidden states and the residual stream), so a single batch's step is not faster; with M
  batches in flight (vLLM's batch queue) a stage works on one batch while the next stage works on
  another, and the engine completes a step every max(stage time) once the pipe is full.

Assumptions: ranks are identical and balanced; communication does not overlap compute (tokenloom's
row-parallel all-reduce blocks, as vLLM's CPU path does); the link's latency and bandwidth are the
achieved ones (measure with benchmarks/parallel/allreduce.py), not the wire's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One hop between ranks: seconds per message = latency_s + bytes / bandwidth_bytes_s."""

    latency_s: float
    bandwidth_bytes_s: float

    def message_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of `nbytes` over `ranks`: reduce-scatter + all-gather, 2 (N - 1) steps."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * self.message_s(nbytes / ranks)


# Presets (achieved, not nominal): one node's shared-memory all-reduce between NUMA nodes (a few
# microseconds, memory-copy bandwidth), TCP over 25 GbE, and RDMA over 100 Gb InfiniBand / RoCE.
SHARED_MEMORY = Link(latency_s=5e-6, bandwidth_bytes_s=20e9)
ETHERNET_25G = Link(latency_s=30e-6, bandwidth_bytes_s=2.5e9)
RDMA_100G = Link(latency_s=3e-6, bandwidth_bytes_s=11e9)


@dataclass(frozen=True)
class ParallelStep:
    latency_s: float  # one batch through the whole model (what a decode step costs a request)
    interval_s: float  # time between completed steps with the pipe full (= latency without PP)
    comm_s: float  # of latency_s, the communication

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.latency_s if self.latency_s else 0.0


def parallel_step_time(compute_s: float, tokens: int, num_layers: int, hidden_size: int, *, tp: int = 1,
                       pp: int = 1, tp_link: Link = SHARED_MEMORY, pp_link: Link = ETHERNET_25G,
                       act_bytes: int = 2, vocab_size: int = 0, efficiency: float = 1.0,
                       batches_in_flight: int | None = None) -> ParallelStep:
    """The step time of one batch of `tokens` rows (see the module docstring); `compute_s`: the same
    step on one rank holding the whole model (measured, or weight bytes / memory bandwidth)."""
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be >= 1")
    per_rank = compute_s / (tp * pp) / efficiency
    row = tokens * hidden_size * act_bytes
    stage_layers = num_layers / pp
    tp_comm = (2 * stage_layers + 1) * tp_link.allreduce_s(row, tp)
    if tp > 1 and vocab_size:  # the logits' all-gather (fp32), on the last stage
        tp_comm += tp_link.allreduce_s(tokens * vocab_size * 4 / 2, tp) / pp
    stage_s = per_rank + tp_comm
    pp_comm = (pp - 1) * pp_link.message_s(2 * row) if pp > 1 else 0.0
    latency = pp * stage_s + pp_comm
    in_flight = pp if batches_in_flight is None else batches_in_flight
    interval = latency / min(in_flight, pp) if pp > 1 else latency
    return ParallelStep(latency, max(interval, stage_s), pp * tp_comm + pp_comm)


# Llama-3-70B's shape and a Q4_K_M file's size; a decode step on one node streams the weights once.
LLAMA_70B = dict(num_layers=80, hidden_size=8192, vocab_size=128256, weight_bytes=42.5e9)


def project_70b(node_bandwidth_bytes_s: float = 200e9, nodes: int = 4,
                tokens: int = 1) -> list[tuple[str, ParallelStep]]:
    """The 70B model's decode step on `nodes` nodes of `node_bandwidth_bytes_s` achieved memory
    bandwidth each, per parallel layout and link (the table in docs/parallelism.md)."""
    m = LLAMA_70B
    one = m["weight_bytes"] / node_bandwidth_bytes_s  # what one node would take, were it big enough
    shape = dict(tokens=tokens, num_layers=m["num_layers"], hidden_size=m["hidden_size"], vocab_size=m["vocab_size"])
    return [
        ("1 node (does not fit 24 GiB; reference)", parallel_step_time(one, **shape)),
        (f"TP={nodes}, 25 GbE", parallel_step_time(one, **shape, tp=nodes, tp_link=ETHERNET_25G)),
        (f"TP={nodes}, 100G RDMA", parallel_step_time(one, **shape, tp=nodes, tp_link=RDMA_100G)),
        (f"PP={nodes}, 25 GbE, 1 batch in flight", parallel_step_time(one, **shape, pp=nodes, batches_in_flight=1)),
        (f"PP={nodes}, 25 GbE, {nodes} batches in flight", parallel_step_time(one, **shape, pp=nodes)),
        ("TP=2 x PP=2, 25 GbE", parallel_step_time(one, **shape, tp=2, pp=2, tp_link=ETHERNET_25G)),
        ("TP=2 over one node's 2 sockets (shared memory; SGLang's setting)",
         parallel_step_time(one, **shape, tp=2, tp_link=SHARED_MEMORY)),
    ]


if __name__ == "__main__":
    print(f"{'layout':62s} {'step ms':>8s} {'interval ms':>12s} {'comm %':>7s}")
    for name, step in project_70b():
        print(f"{name:62s} {step.latency_s * 1e3:8.1f} {step.interval_s * 1e3:12.1f} {100 * step.comm_fraction:6.1f}%")
