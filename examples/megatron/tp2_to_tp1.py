"""Save a Megatron-Core GPTModel with bcp at tensor parallel size 2, load it at size 1.

    python examples/megatron/tp2_to_tp1.py [CHECKPOINT_DIR]

Runs on the CPU with gloo: two processes build the TP=2 model and save it through Megatron's
``dist_checkpointing`` with the ``bcp`` backend, then one process builds the TP=1 model, loads the
checkpoint (Megatron picks bcp from ``metadata.json``) and checks every weight against the
TP=2 model, gathered. The checkpoint is an ordinary bcp checkpoint: ``bcp inspect DIR``.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build_gpt(seed: int) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, whole, on every rank: each main replica fills its box, the ranks sum them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    out = {}
    for value in model.sharded_state_dict().values():
        if not isinstance(value, ShardedTensor):
            continue
        whole = out.setdefault(value.key, torch.zeros(value.global_shape, dtype=value.dtype))
        if is_main_replica(value.replica_id):
            data = value.data.detach()
            for _ in range(value.prepend_axis_num):
                data = data.unsqueeze(0)
            whole[tuple(slice(o, o + n) for o, n in zip(value.global_offset, data.shape))] = data
    for whole in out.values():
        dist.all_reduce(whole)
    return out


def run(rank: int, world: int, port: int, path: str, role: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing, parallel_state

    import bcp_megatron  # noqa: F401  (registers the 'bcp' backend with Megatron-Core)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if role == "save":
        model = build_gpt(seed=1)
        dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=("bcp", 1))
        if rank == 0:
            torch.save(whole_weights(model), os.path.join(path, "..", "expected.pt"))
        else:
            whole_weights(model)
    else:
        model = build_gpt(seed=2)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
        expected = torch.load(os.path.join(path, "..", "expected.pt"))
        loaded = whole_weights(model)
        same = all(torch.equal(expected[k], loaded[k]) for k in expected)
        print(f"TP=1 model loaded from the TP=2 checkpoint: {len(loaded)} tensors, bitwise equal: {same}")
        if not same:
            sys.exit(1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="bcp-megatron-")
    path = os.path.join(root, "ckpt")
    os.makedirs(path, exist_ok=True)
    mp.start_processes(run, args=(2, free_port(), path, "save"), nprocs=2, start_method="spawn")
    print(f"saved at TP=2: {path}")
    mp.start_processes(run, args=(1, free_port(), path, "load"), nprocs=1, start_method="spawn")


if __name__ == "__main__":
    main()
