"""A seeded, resumable walk over a RowSource: epoch after epoch, each a fresh permutation of the rows.

Epoch e visits the rows in the order of a permutation seeded by (seed, e), so the order is a pure function of
(seed, the source's size and row groups) and a run resumed from `state_dict()` (epoch, position) reads exactly the
rows an uninterrupted run would. Only the current epoch's permutation is held: int32 while the rows fit (4 bytes a
row, 40 MB at 10M rows), built by torch.randperm.

Sources read in blocks (parquet row groups: `source.block_ends()`) get a block shuffle instead of a uniform one: a
random order of the blocks, cut into windows of `block_window` blocks, each window's rows in a random order. A
uniform permutation would decode a whole row group for nearly every row read (~10 ms each); this reads each group
once an epoch while still mixing rows of `block_window` random groups. jsonl and reasoning-gym sources (cheap random
access) get the uniform permutation.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .sources import DataError, Row, RowSource


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch): hashed so that nearby seeds give unrelated orders."""
    digest = hashlib.blake2b(f"mpo-rowstream:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


FINGERPRINT_ROWS = 16  # rows whose content identifies the data on resume (RowStream.fingerprint)
DEFAULT_BLOCK_WINDOW = 4  # parquet row groups mixed at a time (sources.PARQUET_CACHE_GROUPS holds them decoded)


def epoch_permutation(n: int, seed: int, epoch: int, block_ends: np.ndarray | None = None,
                      block_window: int = DEFAULT_BLOCK_WINDOW) -> torch.Tensor:
    """The order of epoch `epoch`: uniform, or the block shuffle when `block_ends` (cumulative block sizes) is given."""
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    dtype = torch.int32 if n < 2**31 else torch.int64
    if block_ends is None or len(block_ends) <= block_window:  # every block fits in the window: uniform is free
        return torch.randperm(n, generator=generator, dtype=dtype)
    ends = torch.as_tensor(np.asarray(block_ends), dtype=torch.int64)
    sizes = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64))
    order = torch.randperm(len(ends), generator=generator)
    window_of_block = torch.empty(len(ends), dtype=torch.int32)
    window_of_block[order] = (torch.arange(len(ends)) // block_window).to(torch.int32)
    uniform = torch.randperm(n, generator=generator, dtype=dtype)
    # Rows grouped by their block's window (windows in the blocks' random order); a stable sort keeps the uniform
    # order inside each window (vectorised: a loop over blocks was ten times slower).
    window_of_row = torch.repeat_interleave(window_of_block, sizes)[uniform.long()]
    return uniform[torch.sort(window_of_row, stable=True).indices]


class RowStream:
    """`take(n)` rows in a seeded order, epoch by epoch; `state_dict()` / `load_state_dict()` to resume. `block_window`:
    see the module doc."""

    def __init__(self, source: RowSource, seed: int, *, block_window: int = DEFAULT_BLOCK_WINDOW) -> None:
        self.source = source
        self.seed = int(seed)
        self.block_window = block_window
        self._rows = len(source)
        if self._rows == 0:
            raise DataError("the data source has no rows")
        block_ends = getattr(source, "block_ends", None)
        self._block_ends = block_ends() if block_ends is not None else None
        self._epoch = 0
        self._position = 0
        self._perm: torch.Tensor | None = None  # the permutation of self._epoch, built on first use
        self._fingerprint: str | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next row comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many rows of the current epoch have been taken."""
        return self._position

    def __len__(self) -> int:
        return self._rows

    def next_index(self) -> int:
        """The source index of the next row, advancing the stream (wrapping into the next epoch)."""
        if self._position >= self._rows:
            self._epoch += 1
            self._position = 0
            self._perm = None
        if self._perm is None:
            self._perm = epoch_permutation(self._rows, self.seed, self._epoch, self._block_ends, self.block_window)
        index = int(self._perm[self._position])
        self._position += 1
        return index

    def take(self, n: int) -> list[Row]:
        """The next `n` rows (crossing into the next epoch when this one runs out)."""
        return [self.source.row(self.next_index()) for _ in range(n)]

    def fingerprint(self) -> str:
        """A digest of the rows' content at FINGERPRINT_ROWS spread positions (first and last included): a resume
        onto another file with the same number of rows is caught, while moving or renaming the data is not refused
        (row positions, "path:line", are left out). Computed once: a few row reads (a few parquet groups)."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=12)
            count = min(self._rows, FINGERPRINT_ROWS)
            for k in range(count):
                index = k * (self._rows - 1) // max(count - 1, 1)
                try:
                    row = self.source.row(index)
                    piece = repr((row.prompt, row.messages, row.answer, sorted(row.metadata.items(), key=str)))
                except DataError as exc:  # a bad row is part of the content too (the run skips it)
                    piece = f"bad row: {exc}"
                digest.update(f"{index}:{piece}\n".encode("utf-8", "surrogatepass"))
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "rows": self._rows,
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        rows = state.get("rows", self._rows)
        if rows != self._rows:
            raise DataError(f"resume: the data had {rows} rows when saved and has {self._rows} now; "
                            "the saved position does not apply to changed data")
        if state.get("seed", self.seed) != self.seed:
            raise DataError(f"resume: the data order was seeded with {state['seed']}, this run with {self.seed}")
        saved = state.get("fingerprint")  # absent in checkpoints written before it was recorded
        if saved is not None and saved != self.fingerprint():
            raise DataError(f"resume: the data has the {self._rows} rows it had when saved but not the same content "
                            "(rows sampled across it differ): the saved position does not apply to other data; "
                            "point the data settings back at the run's data, or start a new run (another logging.out_dir)")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._rows:
            raise DataError(f"resume: bad stream state epoch={epoch} position={position} for {self._rows} rows")
        self._epoch, self._position, self._perm = epoch, position, None
