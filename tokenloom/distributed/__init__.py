"""Tensor and pipeline parallelism's communication (vLLM's vllm/distributed): process groups over
torch.distributed (gloo), the collectives the sharded model calls, and a shared-memory all-reduce for
ranks on one node (vLLM's CPU communicator). Below tokenloom/model: the model's layers call these."""

from tokenloom.distributed.communication_op import (
    comm_stats,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenloom.distributed.parallel_state import (
    GroupCoordinator,
    destroy_model_parallel,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "GroupCoordinator", "comm_stats", "destroy_model_parallel", "get_pp_group", "get_tp_group", "get_world_group",
    "init_distributed_environment", "initialize_model_parallel", "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
]
