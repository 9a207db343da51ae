"""Files we create get the mode the user's umask gives a new file, whatever wrote them.

safetensors' writer and tempfile.mkstemp create files 0600; a team sharing a checkpoint or a
data cache through group permissions would find them unreadable. `save_safetensors` and
`as_umask_allows` give such files what open() would have: 0666 less the umask.
"""

import os
from pathlib import Path

from safetensors.torch import save_file


def umask_mode(mode: int = 0o666) -> int:
    """`mode` less the process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def as_umask_allows(path: str | os.PathLike) -> None:
    os.chmod(path, umask_mode())


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors.torch.save_file, then the file's mode from the umask."""
    save_file(tensors, str(path), metadata=metadata)
    as_umask_allows(Path(path))
