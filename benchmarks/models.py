"""Model definitions shared by the benchmarks (definitions only: no training code here)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 16384
    seq: int = 256
    width: int = 768
    layers: int = 12
    heads: int = 12

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls(vocab=256, seq=32, width=64, layers=2, heads=4)

    @classmethod
    def gpt2_small(cls, seq: int = 1024) -> "GPTConfig":
        """GPT-2 small: ≈ 124M parameters (vocabulary padded to a multiple of 64, as nanoGPT does)."""
        return cls(vocab=50304, seq=seq, width=768, layers=12, heads=12)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer (GPT-2 layout, tied embeddings). The default config has ≈ 98M parameters."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hidden(tokens) @ self.tok.weight.t()

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last layer's normalised output, before the (tied) output projection."""
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


@dataclass(frozen=True)
class BertConfig:
    """A BERT encoder's shape; the defaults are BERT-base (width 768, 12 layers, 12 heads, WordPiece vocabulary)."""

    vocab: int = 30522
    seq: int = 128
    width: int = 768
    layers: int = 12
    heads: int = 12
    masked: float = 0.15  # the fraction of each sequence's positions the MLM loss predicts

    @classmethod
    def tiny(cls) -> "BertConfig":
        return cls(vocab=256, seq=32, width=64, layers=2, heads=4)


class EncoderLayer(nn.Module):
    """A post-norm BERT layer: bidirectional self-attention, then a 4x GELU MLP, each added and layer-normed."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln1 = nn.LayerNorm(cfg.width, eps=1e-12)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))
        self.ln2 = nn.LayerNorm(cfg.width, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = self.ln1(x + self.proj(attn))
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    """A BERT encoder with its masked-language-model head: token logits at every position.

    No dropout, no token types or padding mask (benchmarks train on full-length random sequences), and the head's
    decoder is its own weight, not the token embedding's: a pipeline cut between the embedding and the head would
    otherwise split a tied weight across stages. The layers are one ``nn.ModuleList``, the blocks a pipeline or a
    sharding splits at. BERT-base so shaped holds ≈ 133M parameters.
    """

    def __init__(self, cfg: BertConfig = BertConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.width))
        self.ln = nn.LayerNorm(cfg.width, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.transform = nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.GELU(), nn.LayerNorm(cfg.width, eps=1e-12))
        self.decoder = nn.Linear(cfg.width, cfg.vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.tok(tokens) + self.pos[: tokens.shape[1]])
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.transform(x))


def mlm_batch(cfg: BertConfig, samples: int, seed: int = 0, mask_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences for masked-language-model training: (inputs, labels). Each sequence has the same number
    of masked positions (``cfg.masked`` of its length, at random places), so the mean loss over masked tokens is the
    mean over sequences of their own means: a global batch's loss splits over ranks by sample count. Inputs carry
    ``mask_id`` at the masked positions; labels are the original token there and -100 (ignored) elsewhere."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, cfg.vocab, (samples, cfg.seq), generator=g)
    count = max(1, round(cfg.masked * cfg.seq))
    positions = torch.rand(samples, cfg.seq, generator=g).argsort(dim=1)[:, :count]
    masked = torch.zeros(samples, cfg.seq, dtype=torch.bool).scatter_(1, positions, True)
    return tokens.masked_fill(masked, mask_id), tokens.masked_fill(~masked, -100)


def bert_parameters(cfg: BertConfig) -> int:
    """Parameters of :class:`Bert` (untied head)."""
    per_layer = 12 * cfg.width**2 + 13 * cfg.width
    embed = (cfg.vocab + cfg.seq) * cfg.width + 2 * cfg.width
    head = cfg.width**2 + 3 * cfg.width + cfg.width * cfg.vocab + cfg.vocab
    return embed + cfg.layers * per_layer + head


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (stride on the 3x3 conv), as in torchvision."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
        )
        self.down = None
        if stride != 1 or inplanes != out:
            self.down = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


def resnet(layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> nn.Sequential:
    """ResNet with bottleneck blocks; the defaults are ResNet-50 (25.6M parameters, the layout of
    ``torchvision.models.resnet50``, used when torchvision is not installed)."""
    stem = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1)]
    stages, inplanes = [], width
    for i, blocks in enumerate(layers):
        planes = width * 2**i
        for j in range(blocks):
            stages.append(Bottleneck(inplanes, planes, stride=2 if i > 0 and j == 0 else 1))
            inplanes = planes * Bottleneck.expansion
    return nn.Sequential(*stem, *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, classes))


def resnet50(classes: int = 1000) -> nn.Module:
    """``torchvision.models.resnet50`` when torchvision is installed, else the same layout from :func:`resnet`."""
    try:
        from torchvision.models import resnet50 as tv_resnet50
    except ImportError:
        return resnet(classes=classes)
    return tv_resnet50(num_classes=classes)


def tiny_resnet(classes: int = 10) -> nn.Module:
    """A two-block ResNet for CPU smoke runs."""
    return resnet(layers=(1, 1), width=8, classes=classes)


def gpt_activation_bytes(cfg: GPTConfig) -> tuple[int, float]:
    """Activation bytes one sample of :class:`GPT` keeps for its backward under bf16 autocast, and the fraction of them
    that checkpointing every block leaves (for :class:`~lightning_hetero.MemoryPolicy`).

    Counted by hand from the tensors autograd saves: per block about 48 bytes per token and width unit (the fp32
    residual stream and layer-norm outputs, bf16 inputs of the four matmuls, q/k/v and the attention output, the
    MLP's 4x-wide GELU input and output); outside the blocks the logits (bf16, their fp32 copy, the log-softmax and
    its gradient: 14 bytes per token and vocabulary entry) and the fp32 embedding and final layer norm. Checkpointed,
    each block keeps its fp32 input and one block is recomputed at a time. An estimate: the strategy's peak report
    shows how far it is from the measured peak.
    """
    token_width = cfg.seq * cfg.width
    per_block = 48 * token_width
    outside = 14 * cfg.seq * cfg.vocab + 12 * token_width
    total = cfg.layers * per_block + outside
    checkpointed = cfg.layers * 4 * token_width + per_block + outside
    return total, min(1.0, checkpointed / total)


def gpt_parameters(cfg: GPTConfig) -> int:
    """Parameters of :class:`GPT` (tied embedding and head)."""
    per_block = 12 * cfg.width**2 + 13 * cfg.width
    return cfg.vocab * cfg.width + cfg.seq * cfg.width + cfg.layers * per_block + 2 * cfg.width
