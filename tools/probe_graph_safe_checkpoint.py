"""Does a checkpointed dropout block replay its forward mask under a graph-safe RNG tracker?

Usage (one CUDA GPU): ``PYTHONPATH=<a tree holding megatron/core> python
tools/probe_graph_safe_checkpoint.py``, for this repository or an upstream checkout alike (it
uses upstream's names only). The block is checkpointed, its stream is forked three more times,
then backward recomputes it; printed is the fraction of input gradients that disagree with the
forward's dropout mask (0.0 when the recomputation replays the forward's numbers), for a tensor
tracker and a graph-safe one. Results: docs/upstream-tests.md (run 22).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as tp_random


def main():
    """Prints the mismatch fraction for a tensor tracker and a graph-safe one."""
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29555", world_size=1, rank=0)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    for graph_safe in (False, True):
        tp_random.model_parallel_cuda_manual_seed(
            99, use_cudagraphable_rng=graph_safe, force_reset_rng=True
        )

        def block(x):
            with tp_random.get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(x * 2.0, p=0.5, training=True)

        x = torch.randn(4096, device="cuda", requires_grad=True)
        out = tp_random.checkpoint(block, False, x)
        kept = out.detach() != 0
        for _ in range(3):
            block(torch.ones(4096, device="cuda"))
        out.backward(torch.ones_like(out))
        wrong = (x.grad != kept.float() * 4.0).float().mean().item()
        print(f"graph_safe={graph_safe}: fraction of gradients off the forward mask {wrong:.3f}")


if __name__ == "__main__":
    main()
