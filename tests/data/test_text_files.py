"""`--data text:PATH` attacked as the image files are: each path that holds no usable text is one DataError naming
it, and the bytes of any file (binary too) are tokens."""
from __future__ import annotations

import pytest

from minidl.core.errors import DataError
from minidl.data import load_data


def test_a_path_without_usable_text_is_named_and_any_bytes_are_tokens(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"abc")
    for name, words in (("dir", "a directory, not a text file"), ("none.txt", "no such file"),
                        ("empty.txt", "0 tokens make 0 sequence(s) of 16 tokens"),
                        ("short.txt", "3 tokens make 0 sequence(s) of 16 tokens")):
        with pytest.raises(DataError) as e:
            load_data(f"text:{tmp_path / name}", seq=16)
        assert name in str(e.value) and words in str(e.value), str(e.value)
    (tmp_path / "bin").write_bytes(bytes(range(256)) * 3)   # any bytes are tokens: 47 windows, the last 10% held out
    train, held = load_data(f"text:{tmp_path / 'bin'}", seq=16)
    assert train.x.max() == 255 and (len(train), len(held)) == (42, 5)
