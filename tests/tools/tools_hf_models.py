"""A tiny Hugging Face causal LM built from a config (no hub), shared by the tools' HF tests."""

from __future__ import annotations

import torch

PROBE = torch.tensor([[3, 17, 42, 5, 61, 8, 29, 90, 11, 2]])


def llama_config():
    from transformers import LlamaConfig

    # Tied embeddings, so export and convert must handle a weight held under two names.
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def llama(seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


def fully_shard_llama(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits.detach().clone()


def train_step(model) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(24).remainder(96).view(2, 12)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
