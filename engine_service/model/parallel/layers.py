"""The layers that differ on a tensor-parallel rank, and the sharded Llama built from them.

Each rank runs llama.py's model with its heads and MLP columns (shard.local_config); around it:
the embedding looks up the rank's vocabulary rows and all-reduces (each token's row is on one
rank, the others add zeros: exact), o_proj and down_proj all-reduce their partial sums (the
one place TP's results can differ from one device's: the summation order), and the LM head's
per-rank logits are gathered on rank 0.

On the CPU a rank runs the Python layer loop, not the fused C++ decoder (fused_decoder.py):
the C++ loop has no point between layers to call a collective from, and the per-layer path
costs a rank only the Python dispatch between kernels (~5 ms a step, measured when the fused
loop came in), against a step's 62 collectives that took ~137 ms a step on the shared 2-core
machine (bench/README.md, "Tensor parallelism on the CPU": TP=1's per-layer runs were 0.83x
its fused ones there, inside that sitting's noise). Decided in build_sharded_model, which
sets no fused decoder, and in sharded_loader, which packs the linears without one.
"""

import torch
from torch import nn
from torch.nn import functional as F

from engine_service.model.config import ModelConfig
from engine_service.model.models.llama import LlamaForCausalLM
from engine_service.model.parallel.group import TensorParallelGroup
from engine_service.model.parallel.shard import TensorShard, local_config


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: TensorShard, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size))
        self.first_row = shard.vocab.start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(x)


class AllReduceAfter(nn.Module):
    """A row-parallel linear: this rank's input columns, the sum over ranks after."""

    def __init__(self, linear: nn.Linear, group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear  # an nn.Linear until pack_linear_layers packs it
        self.group = group

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class GatheredLMHead(nn.Module):
    """This rank's vocabulary rows; on rank 0 the whole vocabulary's logits, in order (the
    padding rows of the last rank dropped). Other ranks get their own rows (unused)."""

    def __init__(self, linear: nn.Linear, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.group = group

    @property
    def out_features(self) -> int:
        """The width of what forward returns here (the graphs' logits buffer is this wide)."""
        return self.vocab_size if self.group.rank == 0 else self.linear.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden).contiguous()
        parts = self.group.gather_to_first(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def build_sharded_model(config: ModelConfig, shard: TensorShard,
                        group: TensorParallelGroup) -> LlamaForCausalLM:
    """llama.py's model at this rank's sizes with the parallel layers in place (build it on
    the meta device: the loader assigns the weights)."""
    model = LlamaForCausalLM(local_config(config, shard))
    model.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, group)
    head = nn.Linear(config.hidden_size, shard.vocab_per_rank, bias=False)
    if config.tie_word_embeddings:
        head.weight = model.embed_tokens.weight
    model.lm_head = GatheredLMHead(head, config.vocab_size, group)
    for layer in model.layers:
        layer.self_attn.o_proj = AllReduceAfter(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = AllReduceAfter(layer.mlp.down_proj, group)
    return model
