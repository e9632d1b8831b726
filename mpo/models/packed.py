"""One packed micro-batch: several sequences laid end to end in one row, no padding between them.

The model runs on the packed row ``[1, S]``; everything per token that the losses read (masks, advantages, engine
log-probs, old/reference log-probs, router-shift gammas, values) lives in the *sample layout* ``[n, L]`` (one row per
sequence, right-padded), exactly as in a padded micro-batch, so every loss and its global denominators are unchanged.
:meth:`PackedLayout.unpack` moves per-token model outputs (log-probs, entropies, values, gammas) from the packed row
into the sample layout (differentiably: one gather), :meth:`PackedLayout.pack` the other way (masks for routing
metrics, whose records are in the model's layout).

Attention must not cross sequences. One switch per device (`thd`):
* Transformer Engine (GPU): megatron's ``PackedSeqParams`` (THD, ``cu_seqlens``); TE's fused RoPE restarts the
  positions of each sequence.
* megatron's local spec (CPU, GPU without TE): a block-diagonal causal mask ``[1, 1, S, S]`` (True = masked, the
  convention of megatron's ``attention_mask_func``). RoPE there runs over the row's continuous positions; rotary
  attention depends only on the distance between query and key, and inside one block those distances are the same as
  with restarted positions, so the attention is the same (tests/test_packing.py proves it against unpacked rows).

``position_ids`` restart at 0 per sequence either way: :func:`mpo.models.logprobs.sequence_logprobs` scores nothing at
a sequence's first token. The row's tail beyond the last sequence (padding to a multiple of TP, or to the pass's one
shape under PP) is one more sequence of its own that no sample reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedLayout:
    """Where the sequences of one packed row sit.

    Attributes:
        seq_lens: the lengths of the sequences in the row, in order (the samples, then the padding tail if any);
            they sum to the row length S.
        index: ``[n, L]`` long, the position in the row of token t of sample i (0 where t is beyond the sample).
        valid: ``[n, L]`` bool, t < length of sample i.
        thd: the device switch: True for Transformer Engine's THD format, False for a block-diagonal mask.
    """

    seq_lens: tuple[int, ...]
    index: torch.Tensor
    valid: torch.Tensor
    thd: bool = False
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(cls, sample_lens: list[int], row_len: int, *, thd: bool) -> "PackedLayout":
        used = sum(sample_lens)
        if used > row_len:
            raise ValueError(f"sequences of {used} tokens do not fit a packed row of {row_len}")
        seq_lens = tuple(sample_lens) + ((row_len - used,) if row_len > used else ())
        width = max(sample_lens)
        starts = torch.tensor([0, *sample_lens[:-1]]).cumsum(0)
        t = torch.arange(width)
        valid = t[None, :] < torch.tensor(sample_lens)[:, None]
        index = torch.where(valid, starts[:, None] + t[None, :], 0)
        return cls(seq_lens, index, valid, thd)

    @property
    def row_len(self) -> int:
        return sum(self.seq_lens)

    def position_ids(self) -> torch.Tensor:
        """``[1, S]``: 0.. per sequence."""
        return torch.cat([torch.arange(n) for n in self.seq_lens])[None]

    def to(self, device: torch.device | str) -> "PackedLayout":
        return PackedLayout(self.seq_lens, self.index.to(device), self.valid.to(device), self.thd)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, S, ...]`` model layout -> ``[n, L, ...]`` sample layout (0 beyond each sample)."""
        flat = x.reshape(self.row_len, *x.shape[2:])
        out = flat[self.index.to(flat.device)]
        valid = self.valid.to(flat.device).view(*self.valid.shape, *([1] * (x.dim() - 2)))
        return out.masked_fill(~valid, 0)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, L', ...]`` sample layout (L' >= L) -> ``[1, S, ...]`` model layout (0 in the padding tail)."""
        x = x[:, : self.index.shape[1]]
        out = x.new_zeros(self.row_len, *x.shape[2:])
        valid = self.valid.to(x.device)
        out[self.index.to(x.device)[valid]] = x[valid]
        return out[None]

    def attention_mask(self, device: torch.device | str) -> torch.Tensor:
        """``[1, 1, S, S]`` bool, True where a query may not attend (another sequence, or the future)."""
        if self._mask is None or self._mask.device != torch.device(device):
            seq = torch.repeat_interleave(torch.arange(len(self.seq_lens), device=device),
                                          torch.tensor(self.seq_lens, device=device))
            future = torch.ones(self.row_len, self.row_len, dtype=torch.bool, device=device).triu_(1)
            self._mask = ((seq[:, None] != seq[None, :]) | future)[None, None]
        return self._mask

    def forward_kwargs(self, device: torch.device | str) -> dict:
        """What the model's forward takes to keep attention inside each sequence (see the module docstring)."""
        if not self.thd:
            return {"attention_mask": self.attention_mask(device)}
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0, *self.seq_lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        longest = max(self.seq_lens)
        return {"attention_mask": None,
                "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)}
