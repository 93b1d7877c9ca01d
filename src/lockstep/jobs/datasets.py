"""The built-in jobs' data, all available without a download at run time.

toy and resnet are synthetic (made from a fixed seed, identical on every rank); digits is scikit-learn's
bundled 8x8 digits; mnist reads MNIST-format IDX files (Debian's dataset-fashion-mnist ships them);
gpt reads text that every Python install ships: the standard library's own source files.
"""

from __future__ import annotations

import gzip
import struct
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lockstep.errors import ConfigError
from lockstep.jobs.configs import DEFAULT_MNIST_DIR

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
STDLIB_TEXTS = ("textwrap.py", "difflib.py", "argparse.py", "shutil.py", "string.py", "glob.py", "fnmatch.py")


def toy_regression(num_samples: int, *, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The tutorial's ToyModel task: 10 features to 5 targets by a fixed random linear map, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(10, 5, generator=gen)
    x = torch.randn(num_samples + num_samples // 4, 10, generator=gen)
    y = x @ weight + 0.1 * torch.randn(x.shape[0], 5, generator=gen)
    return TensorDataset(x[:num_samples], y[:num_samples]), TensorDataset(x[num_samples:], y[num_samples:])


def digits(*, seed: int = 0, test_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    """scikit-learn's 8x8 handwritten digits (1797 images), split train/test by a fixed permutation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the digits job needs scikit-learn: pip install 'lockstep[digits]'") from None
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(len(y) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def mnist(data_dir: str) -> tuple[Dataset, Dataset]:
    """MNIST-format IDX files (plain or .gz) from `data_dir`, scaled to [0, 1] and normalised."""
    root = Path(data_dir)
    paths = {key: _find_idx(root, name) for key, name in IDX_FILES.items()}
    missing = [IDX_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise ConfigError(
            f"no MNIST-format data in {str(root)!r}: missing {', '.join(missing)} (plain or .gz). "
            "Put the four IDX files of MNIST (or Fashion-MNIST) there and pass --data DIR, or install Debian's "
            f"Fashion-MNIST with `apt-get install dataset-fashion-mnist` (it lands in {DEFAULT_MNIST_DIR})"
        )
    images = {key: read_idx(paths[key]) for key in ("train_images", "test_images")}  # type: ignore[arg-type]
    labels = {key: read_idx(paths[key]) for key in ("train_labels", "test_labels")}  # type: ignore[arg-type]

    def tensors(kind: str) -> TensorDataset:
        x = torch.from_numpy(images[f"{kind}_images"].astype(np.float32) / 255.0)
        x = ((x - 0.2860) / 0.3530).unsqueeze(1)
        return TensorDataset(x, torch.from_numpy(labels[f"{kind}_labels"].astype(np.int64)))

    return tensors("train"), tensors("test")


def _find_idx(root: Path, name: str) -> Path | None:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format): magic, dimension sizes, then unsigned bytes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    zero, dtype_code, num_dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ConfigError(f"{path} is not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    shape = struct.unpack(f">{num_dims}I", data[4 : 4 + 4 * num_dims])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * num_dims)
    if body.size != int(np.prod(shape)):
        raise ConfigError(f"{path} is truncated: header says {shape}, found {body.size} values")
    return body.reshape(shape)


def synthetic_images(num_samples: int, *, num_classes: int = 10, seed: int = 0) -> tuple[Dataset, Dataset]:
    """32x32 RGB images whose class decides a stripe frequency and a colour, under noise: learnable, not trivial."""
    gen = torch.Generator().manual_seed(seed)
    total = num_samples + num_samples // 4
    labels = torch.randint(0, num_classes, (total,), generator=gen)
    coords = torch.linspace(0, 2 * torch.pi, 32)
    freq = (1 + labels % 5).float().view(-1, 1, 1)
    angle = torch.where(labels < 5, 0.0, 1.0).view(-1, 1, 1)
    grid = coords.view(1, 1, 32) * (1 - angle) + coords.view(1, 32, 1) * angle
    pattern = torch.sin(freq * grid)
    colour = torch.nn.functional.one_hot(labels % 3, 3).float().view(-1, 3, 1, 1) + 0.5
    images = pattern.unsqueeze(1) * colour + 0.8 * torch.randn(total, 3, 32, 32, generator=gen)
    return TensorDataset(images[:num_samples], labels[:num_samples]), TensorDataset(
        images[num_samples:], labels[num_samples:]
    )


class CharText(Dataset):
    """Windows of `context + 1` characters; input is the first `context`, target the next ones."""

    def __init__(self, text: str, vocab: list[str], context: int) -> None:
        index = {char: i for i, char in enumerate(vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.context = context
        self.num_windows = (len(self.data) - 1) // context

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.context : (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


def stdlib_text(context: int, *, max_chars: int = 400_000) -> tuple[Dataset, Dataset, int]:
    """Character-level text from the standard library's own sources: (train, test, vocab size)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8", errors="replace")
        for name in STDLIB_TEXTS
        if (stdlib / name).is_file()
    ]
    if not texts:
        raise ConfigError(f"found none of {STDLIB_TEXTS!r} in the standard library at {stdlib}")
    text = "\n".join(texts)[:max_chars]
    vocab = sorted(set(text))
    cut = int(len(text) * 0.9)
    return CharText(text[:cut], vocab, context), CharText(text[cut:], vocab, context), len(vocab)
