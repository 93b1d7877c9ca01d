"""Checkpoint paths and durable writes, without a process group."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lockstep.checkpoint import storage
from lockstep.checkpoint.layout import (
    CheckpointLayout,
    check_entry_name,
    parse_step,
    step_dirname,
    steps_to_prune,
)
from lockstep.errors import ConfigError


def test_step_names_round_trip_and_sort_like_steps() -> None:
    assert step_dirname(500) == "step_000500"
    assert step_dirname(12_345_678) == "step_12345678"
    for step in (0, 7, 500, 999_999, 12_345_678):
        assert parse_step(step_dirname(step)) == step
    for other in ("latest", "step_5", ".tmp-step_000500-1-ab", "step_000500.bak", "step_-00001"):
        assert parse_step(other) is None


def test_layout_paths() -> None:
    layout = CheckpointLayout(Path("/runs/a"))
    assert layout.root == Path("/runs/a/checkpoints")
    assert layout.step_dir(500) == Path("/runs/a/checkpoints/step_000500")
    assert layout.latest == Path("/runs/a/checkpoints/latest")
    temp, old = layout.temp_dir(500, "12-ab"), layout.old_dir(500, "12-ab")
    assert layout.is_leftover(temp.name) and layout.is_leftover(old.name)
    assert not layout.is_leftover("step_000500")
    assert layout.replaced_step(old.name) == 500 and layout.replaced_step(temp.name) is None


def test_pruning_keeps_the_newest() -> None:
    assert steps_to_prune([300, 100, 500, 200], keep=3) == [100]
    assert steps_to_prune([100], keep=3) == []
    assert steps_to_prune([1, 2, 3], keep=1) == [1, 2]
    with pytest.raises(ConfigError, match="keep must be >= 1"):
        steps_to_prune([1], keep=0)


@pytest.mark.parametrize("name", ["model", "optimizer", "ema.v2", "rank-0_stats"])
def test_entry_names_that_are_fine(name: str) -> None:
    assert check_entry_name(name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../x", "meta.json", "state.pt", 3, "x" * 101])
def test_entry_names_that_would_be_unsafe_file_names(name: object) -> None:
    with pytest.raises(ConfigError, match="checkpoint state names"):
        check_entry_name(name)


def test_write_atomic_replaces_whole_and_records_size_and_sha(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    record = storage.write_atomic(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert record.num_bytes == 11 and record.sha256 == storage.sha256_file(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def half_then_full(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage, "_write_all", half_then_full)
    with pytest.raises(OSError) as info:
        storage.write_atomic(target, b"new content")
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    assert "no space left" in storage.explain_os_error(info.value)


def test_publish_dir_replaces_an_existing_directory(tmp_path: Path) -> None:
    final, temp, old = tmp_path / "step_000001", tmp_path / ".tmp-x", tmp_path / ".old-x"
    final.mkdir()
    (final / "a").write_text("old")
    temp.mkdir()
    (temp / "a").write_text("new")
    storage.publish_dir(temp, final, old)
    assert (final / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


@pytest.mark.parametrize(
    "code,words",
    [
        (errno.EROFS, "read-only"),
        (errno.EACCES, "permission denied"),
        (errno.ENOENT, "does not exist"),
        (errno.EIO, "I/O error"),
    ],
)
def test_os_errors_are_explained(code: int, words: str) -> None:
    assert words in storage.explain_os_error(OSError(code, os.strerror(code)))
