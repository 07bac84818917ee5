"""The Llama family (Llama, Mistral, Qwen2) over flat batches and a paged KV cache.

Parameter names mirror Hugging Face's, except that q/k/v and gate/up are fused at load time
(``qkv_proj``, ``gate_up_proj``); ``checkpoint_sources`` says which checkpoint tensors fill each.
"""

import torch
from torch import nn

from services.engine.attention.base import AttentionBackend, AttentionMetadata
from services.engine.cpu_kernels import fused_ops
from services.engine.models.config import ModelConfig
from services.engine.models.int8_linear import Int8Linear, quantize_linears
from services.engine.models.layers import GatedMLP, RMSNorm, empty_linear
from services.engine.models.packed_linear import PackedLinear, pack_linears
from services.engine.models.paged_attention_op import paged_attention
from services.engine.models.rope import RotaryEmbedding, apply_rotary_

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_pool, v_pool): [num_blocks, block_size, kv_heads, head_dim]
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the step's positions: [T, 1, head_dim] each
_FUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attention: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.sliding_window = config.layer_sliding_windows[layer_index]
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = empty_linear(config.hidden_size, qkv_size, config.attention_bias, dtype, device)
        self.o_proj = empty_linear(self.num_heads * self.head_dim, config.hidden_size, config.o_proj_bias,
                                   dtype, device)
        self.attention = attention

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, heads + 2 * kv_heads, D]
        qk = qkv[:, :self.num_heads + self.num_kv_heads]
        if self.attention.use_triton_kernels:
            from services.engine.kernels.rotary import rotary_

            rotary_(qk, *rope)
        elif fused_ops.can_rotate(qk, *rope):
            fused_ops.rotary_(qk, *rope)
        else:
            apply_rotary_(qk, *rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # q: [T, heads, D], k: [T, kv_heads, D]
        v = qkv[:, self.num_heads + self.num_kv_heads:]  # [T, kv_heads, D]
        out = paged_attention(self.attention, q, k, v, kv_cache[0], kv_cache[1], metadata,
                              self.sliding_window)  # [T, heads, D]
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attention: AttentionBackend, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, attention, dtype, device)
        kernels = attention.use_triton_kernels
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, kernels)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # weights loaded later, so not initialised (skip_init's meta-device init of an embedding imports dynamo: ~2 s)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, attention, dtype, device)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, attention.use_triton_kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary.tables(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [n, H]) -> [n, vocab]`` in float32."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention, max_positions, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else empty_linear(config.hidden_size, config.vocab_size, False, dtype, device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()  # [n, vocab]
        return self.lm_head(hidden).float()

    def pack_linears(self, int8: bool = False) -> None:
        """After loading, on the CPU: every projection, the logits one included (tied or not), runs on
        prepacked weights (see ``packed_linear``), or with ``int8`` on int8 ones (``int8_linear``; a tied
        head gets its own int8 copy, the embeddings stay as they are)."""
        if int8:
            if self.lm_head is None:
                self.lm_head = Int8Linear.rounded(self.model.embed_tokens.weight, None)
            quantize_linears(self)
            return
        pack_linears(self)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.model.embed_tokens.weight, None, weight_is_shared=True)

    def checkpoint_sources(self) -> dict[str, list[str]]:
        """For each parameter, the checkpoint tensors concatenated (along dim 0) to fill it."""
        sources = {}
        for name, _ in self.named_parameters():
            fused = next((key for key in _FUSED if key in name), None)
            sources[name] = [name.replace(fused, part) for part in _FUSED[fused]] if fused else [name]
        return sources
