"""`read_whole`: a file's exact bytes, page-aligned, in private memory on transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from estream import packed
from estream_arena import huge_page_bytes_in, thp_mode


@pytest.mark.parametrize("size", [0, 1, 4095, 3 * 4096, 3 * 4096 + 5])
def test_exact_bytes_across_read_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(packed, "READ_CHUNK", 4096)  # several reads, one partial at the end
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    out = packed.read_whole(path)
    assert out.ctypes.data % mmap.PAGESIZE == 0  # the kernel's copy is fast into aligned pages
    assert out.dtype == np.uint8 and out.shape == (size,)
    assert np.array_equal(out, data)
    if size:
        out[0] ^= 0xFF  # private and writable: the file is untouched
        assert path.read_bytes()[0] == data[0]


def test_missing_file_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        packed.read_whole(tmp_path / "absent.bin")


def test_on_huge_pages_where_the_kernel_grants_them(tmp_path: Path) -> None:
    """A 16 MiB file lands in 2 MiB pages where THP is 'always' or 'madvise' (read_whole advises
    them); where THP is 'never', none."""
    size = 16 << 20
    path = tmp_path / "big.bin"
    np.full(size, 7, np.uint8).tofile(path)
    out = packed.read_whole(path)
    lo = out.ctypes.data
    huge = huge_page_bytes_in([(lo, lo + size)])
    assert 0 <= huge <= size + (2 << 20)
    assert int(out[::4096].sum()) == 7 * (size // 4096)
    if thp_mode() in ("always", "madvise"):
        assert huge >= size // 2, huge
    elif thp_mode() == "never":
        assert huge == 0


def test_a_mapping_refused_is_a_memory_error_naming_file_and_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "pool.bin"
    np.zeros(3 << 20, np.uint8).tofile(path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(packed.ea, "private_mapping", refuse)
    with pytest.raises(
        MemoryError, match=r"pool\.bin: cannot allocate 3\.00 MiB .*Cannot allocate"
    ):
        packed.read_whole(path)
