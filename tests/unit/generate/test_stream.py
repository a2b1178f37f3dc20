"""Streamed text is handed out only when it is final."""

from __future__ import annotations

from attnlab.generate.stream import TextStream


def test_text_stream_holds_back_a_partial_character():
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [stream.push([b]) for b in "aé👍b".encode()]
    assert "".join(pieces) == "aé👍b" and pieces[1] == "" and pieces[3:6] == ["", "", ""]
    assert stream.finish() == ""
    stream.push(list(b"c") + [0xF0])
    assert stream.finish() == "c\ufffd"
