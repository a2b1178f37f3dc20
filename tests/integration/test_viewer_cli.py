"""`attnlab attention` (PNG heatmaps) and `attnlab view` (the local web viewer) from the command line."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from attnlab.cli import main
from tests.unit.analysis.tiny_runs import tiny_run

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("viewer-cli")
    return {kind: tiny_run(folder, kind) for kind in ("encoder_decoder", "hard")}


def run_main(args: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_attention_draws_every_head_and_a_grid_per_layer_of_each_kind(runs, tmp_path, capsys):
    out = tmp_path / "pictures"
    code, stdout, stderr = run_main(["attention", str(runs["encoder_decoder"]), "abc", "--out", str(out)], capsys)
    assert code == 0, stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{kind}_layer{layer}_{what}.png" for kind in ("encoder_self", "decoder_self", "cross")
                           for layer in (0, 1) for what in ("head0", "head1", "heads"))
    assert all((out / name).read_bytes()[:8] == PNG for name in names)
    assert f"wrote {len(names)} attention pictures to {out}" in stdout


def test_attention_of_a_hard_attention_model_adds_the_argmax_pattern(runs, tmp_path):
    out = tmp_path / "hard"
    result = subprocess.run([sys.executable, "-m", "attnlab", "attention", str(runs["hard"]), "abcd", "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    argmax = sorted(p.name for p in out.glob("*_argmax.png"))
    assert argmax == sorted(f"{kind}_layer{layer}_argmax.png" for kind in ("encoder_self", "decoder_self", "cross")
                            for layer in (0, 1))


def test_attention_refuses_symbols_outside_the_alphabet(runs, tmp_path, capsys):
    code, _, stderr = run_main(["attention", str(runs["encoder_decoder"]), "a<b", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert stderr.strip() == "error: input 'a<b': symbol '<' is not in the task's alphabet a b c d e f g h i j"


def test_view_prints_its_url_serves_the_api_and_stops_on_ctrl_c(runs):
    process = subprocess.Popen([sys.executable, "-m", "attnlab", "view", str(runs["encoder_decoder"]), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert url, (line, process.stderr.read() if process.poll() is not None else "")
        with urllib.request.urlopen(url[1] + "api/model", timeout=30) as response:
            assert json.load(response)["model_kind"] == "encoder_decoder"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) in (0, 130)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def test_view_on_a_taken_port_is_an_error_not_a_traceback(runs, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, stderr = run_main(["view", str(runs["encoder_decoder"]), "--port", str(port)], capsys)
    assert code == 2
    assert stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}:")


def test_view_checks_the_importance_file_before_serving(runs, tmp_path, capsys):
    bad = tmp_path / "importance.csv"
    bad.write_text("kind,layer,head,importance\nself,0,0,1.0\n")
    code, stdout, stderr = run_main(["view", str(runs["encoder_decoder"]), "--importance", str(bad)], capsys)
    assert code == 2 and "http" not in stdout
    assert stderr.strip() == f"error: {bad}: line 2: this model has no 'self' attention; it has: cross, decoder_self, encoder_self"
