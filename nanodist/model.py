"""A tiny GPT, written to be read: the model every chapter trains.

    cfg = GPTConfig.preset("tiny", vocab_size=tok.vocab_size)
    model = GPT(cfg)                                  # init from torch's global seed (nanodist.init seeds it)
    logits, loss = model(x, y)                        # x, y: (B, T) int64
    opt = torch.optim.AdamW(model.configure_param_groups(weight_decay=0.1), lr=3e-3)
    out = model.generate(prompt, 100, generator=torch.Generator().manual_seed(0))

The architecture is nanoGPT's (pre-norm blocks, learned positions, GELU MLP, tied embeddings) at toy size,
so a 2-core laptop trains it visibly in seconds. Later chapters wrap or shard it (DDP, ZeRO, FSDP), so
nothing here reads a parameter's shape to decide what to do: shapes come from the config, and the number
of attention heads in a forward pass is inferred from the activations, so a tensor-parallel split of the
heads still runs the same code.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# Named sizes, so labs and notebooks say "tiny" instead of repeating five numbers.
# tiny: 0.1 M parameters; ~100 optimizer steps/s at batch 16 x 64 tokens on 2 idle CPU cores, and its loss on
#       the built-in corpus falls from ln(65) = 4.17 to ~2.2 in 100 steps (AdamW, lr 3e-3).
# small: 0.8 M parameters, ~5 steps/s there: for plots where compute should outweigh communication.
PRESETS = {
    "tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": dict(block_size=256, n_layer=8, n_head=8, n_embd=384),  # 14 M parameters: 54 MiB in fp32
    # GPT-2 small's shape (124 M parameters with its vocabulary padded to 50304): the GPU labs' model
    "gpt2": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50304),
}


@dataclass
class GPTConfig:
    """The model's shape. `bias` adds biases to linear layers and LayerNorms; `tie_weights` shares the
    token embedding with the output layer (fewer parameters, and the usual choice at this size)."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                             f"(each head gets n_embd / n_head channels): change one of them")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size from PRESETS ('tiny', 'small'), with any field overridden (vocab_size usually)."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: use one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        """Plain dict, for results files and checkpoints; GPTConfig(**d) rebuilds it."""
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True  # GPT._init_weights scales it down: see there
        self.resid_drop = nn.Dropout(cfg.dropout)
        # Where the attention's dropout draws its masks: torch's generator. Tensor parallelism gives a rank some of
        # the heads, and this a stream of its own (nanodist.tp.ShardedRandom): its heads are not the others'.
        self.heads_random = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        B, T, _ = q.shape  # the whole sequence (with sequence parallelism, x held this rank's positions only)
        # (B, T, C) -> (B, heads, T, head_dim). The head count is inferred (-1), not read from the config,
        # so the same code runs when tensor parallelism gives this rank only some of the heads.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        with self.heads_random() if p and self.heads_random is not None else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over token ids. forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        # Module construction order fixes the order of draws from torch's global generator, so the same
        # seed gives the same model on every rank: DDP still broadcasts rank 0's weights, but the
        # checkers in nanodist.check can then prove that nothing diverged later.
        self.init_weights()
        # Activation checkpointing (chapter 5): keep only each block's input for backward, and run the block's
        # forward again when backward reaches it -- less memory, one more forward's worth of compute.
        self.activation_checkpointing = False

    def init_weights(self) -> None:
        """Give every parameter its initial value, as the constructor does (and with the same draws from torch's
        generator). For a model built on the meta device, sharded, then materialised with `to_empty()`, whose
        memory holds whatever was there: LayerNorms back to weight 1 and bias 0, the rest as GPT-2 does. A plain
        module's to_empty() also unties the head from the token embedding (each module gets its own new tensor):
        they are tied again here. (fully_shard's to_empty keeps the tie.)"""
        if self.config.tie_weights and self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual", False):
                # GPT-2: each residual branch adds variance; scale its output layer by 1/sqrt(2 * n_layer)
                # so the residual stream keeps unit scale however deep the model.
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # LayerNorm keeps torch's default (weight 1, bias 0).

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (B, T) token ids, T <= block_size. Returns logits (B, T, vocab) -- with the vocabulary split
        over ranks (nanodist.tp, vocab=True), this rank's (B, T, vocab / ranks) -- and, with targets (B, T),
        the mean cross-entropy over all positions (targets == -1 are ignored); loss is None without targets.
        The loss is computed in float32 even under autocast, so bf16 runs report comparable numbers."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}: "
                             f"crop the input or build the model with a larger block_size")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            # non-reentrant checkpointing: the recomputed forward sees the same random state (dropout)
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # a head split by vocabulary (nanodist.tp) holds a slice of the logits: it brings its own loss
            cross_entropy = getattr(self.lm_head, "cross_entropy", F.cross_entropy)
            loss = cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied weight counts once). exclude_embeddings drops the position
        embedding, and the token embedding too unless it doubles as the output layer (it then does compute)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None, num_params: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: 6 per weight that takes part in a matmul plus
        attention's 12 * n_layer * n_embd * T (PaLM appendix B), for nanodist.perf's MFU. num_params: the
        model's distinct parameters when they live elsewhere (FSDP's units hold them)."""
        cfg, T = self.config, seq_len or self.config.block_size
        if num_params is None:
            n = self.num_params(exclude_embeddings=True)
        else:
            n = num_params - cfg.block_size * cfg.n_embd - (0 if cfg.tie_weights else cfg.vocab_size * cfg.n_embd)
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * T

    def configure_param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups: weight decay on matrices (dim >= 2: linear weights, embeddings), none on
        biases and LayerNorm gains, which only shift and scale. Each group carries its `param_names`, so
        torch optimizers (and nanodist.check) can name the state of every parameter.

            torch.optim.AdamW(model.configure_param_groups(0.1), lr=3e-3)
        """
        decay, no_decay = [], []
        for name, p in self.named_parameters():  # named_parameters yields a tied weight once
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append((name, p))
        return [
            {"params": [p for _, p in decay], "param_names": [n for n, _ in decay], "weight_decay": weight_decay},
            {"params": [p for _, p in no_decay], "param_names": [n for n, _ in no_decay], "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, generator: torch.Generator | None = None,
                 temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T) and return the (B, T + max_new_tokens) ids.

        Sampling draws only from `generator`, never from torch's global generator, so generating text in
        the middle of training changes neither the training run nor a checkpoint's RNG state. The same
        generator seed gives the same text. temperature=0 is greedy decoding and needs no generator.
        Runs in eval mode (no dropout) and restores the previous mode afterwards.
        """
        if hasattr(self.lm_head, "cross_entropy"):
            raise ValueError("this model's output layer is split by vocabulary (nanodist.tp, vocab=True): each rank "
                             "holds a slice of the logits, so it cannot sample alone; generate with the unsplit "
                             "model (load its checkpoint into one process)")
        if getattr(self, "sequence_split", None):
            raise ValueError("this model splits each sequence over its tensor-parallel ranks (nanodist.tp, "
                             "sequence=True), and generating grows the context one token at a time, a length the "
                             "ranks cannot split evenly: generate with the unsplit model (load its checkpoint into "
                             "one process)")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature > 0 and generator is None:
            raise ValueError("sampling needs an explicit generator so that it draws no global random numbers: "
                             "pass generator=torch.Generator().manual_seed(0), or temperature=0 for greedy")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -self.config.block_size:]
                logits, _ = self(context)
                logits = logits[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    # multinomial wants the generator and the tensor on one device.
                    nxt = torch.multinomial(probs.to(generator.device), 1, generator=generator).to(idx.device)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx
