"""The one exception type the converter raises for bad inputs; the CLI prints it as one line and exits 2."""

from __future__ import annotations


class ConversionError(Exception):
    """A checkpoint cannot be converted: unsupported architecture, missing shard or tensor, shape mismatch.

    The message is one line and names the file and the tensor involved.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        parts = [message]
        if file is not None:
            parts.append(f"file={file}")
        if tensor is not None:
            parts.append(f"tensor={tensor}")
        super().__init__(" | ".join(parts).replace("\n", " "))
        self.file = file
        self.tensor = tensor
