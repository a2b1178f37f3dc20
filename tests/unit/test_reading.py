"""attnlab.reading: read_capped reads within its cap whatever the file is; stream_lines reads a corpus
line by line from a byte offset."""

from __future__ import annotations

import os
import threading

import pytest

from attnlab.errors import DataError
from attnlab.limits import MAX_INPUT_BYTES
from attnlab.reading import read_capped, stream_lines


def test_a_file_within_the_cap_is_read_whole(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the cat\nsat\n")
    assert read_capped(path) == b"the cat\nsat\n"
    assert read_capped(path, cap=12) == b"the cat\nsat\n"  # exactly the cap


def test_a_file_past_the_cap_is_refused_naming_it(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"x" * 13)
    with pytest.raises(DataError, match=r"corpus.txt: more than 12 bytes, the cap .*MAX_INPUT_BYTES"):
        read_capped(path, cap=12)


def test_an_endless_device_is_refused_after_one_bounded_read():
    with pytest.raises(DataError, match=f"/dev/zero: more than {MAX_INPUT_BYTES:,} bytes"):
        read_capped("/dev/zero")


@pytest.mark.skipif(not os.path.exists("/dev/fd"), reason="needs /dev/fd")
def test_an_endless_pipe_is_refused_and_an_idle_one_is_empty(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_capped(fifo) == b""  # no writer: the open does not wait, the read finds the end
    read_end, write_end = os.pipe()

    def write_forever() -> None:
        try:
            while True:
                os.write(write_end, b"y" * 4096)
        except OSError:  # the reader closed its end, at the cap
            pass
        finally:
            os.close(write_end)

    writer = threading.Thread(target=write_forever, daemon=True)
    writer.start()
    try:
        with pytest.raises(DataError, match="more than 1,000 bytes"):
            read_capped(f"/dev/fd/{read_end}", cap=1000)
    finally:
        os.close(read_end)
    writer.join()


def test_a_missing_file_is_left_to_the_caller_as_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_capped(tmp_path / "missing.txt")


def test_stream_lines_numbers_lines_past_blank_ones_and_resumes_at_an_offset(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes("one\r\n\n  \ntwo é\nthree".encode())
    lines = list(stream_lines(path, max_line_chars=100))
    assert [(line.number, line.text) for line in lines] == [(1, "one"), (4, "two é"), (5, "three")]
    assert lines[-1].end == path.stat().st_size
    again = list(stream_lines(path, max_line_chars=100, start=lines[0].end, number=lines[0].number + 1))
    assert again == lines[1:]


def test_stream_lines_refuses_what_is_not_a_regular_file(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        list(stream_lines(tmp_path, max_line_chars=100))
    with pytest.raises(DataError, match="cannot read"):
        list(stream_lines(tmp_path / "missing.txt", max_line_chars=100))
