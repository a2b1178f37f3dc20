"""`attnlab attention` (PNG heatmaps) and `attnlab view` (the local web viewer) from the command line."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from attnlab.cli import main
from attnlab.viewer.importance import MAX_IMPORTANCE_BYTES
from attnlab.viewer.server import MAX_RUN_BODY_BYTES
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
    assert names == sorted(
        f"{kind}_layer{layer}_{what}.png"
        for kind in ("encoder_self", "decoder_self", "cross")
        for layer in (0, 1)
        for what in ("head0", "head1", "heads")
    )
    assert all((out / name).read_bytes()[:8] == PNG for name in names)
    assert f"wrote {len(names)} attention pictures to {out}" in stdout


def test_attention_of_a_hard_attention_model_adds_the_argmax_pattern(runs, tmp_path):
    out = tmp_path / "hard"
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "attention", str(runs["hard"]), "abcd", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    argmax = sorted(p.name for p in out.glob("*_argmax.png"))
    assert argmax == sorted(
        f"{kind}_layer{layer}_argmax.png" for kind in ("encoder_self", "decoder_self", "cross") for layer in (0, 1)
    )


def test_attention_refuses_symbols_outside_the_alphabet(runs, tmp_path, capsys):
    code, _, stderr = run_main(["attention", str(runs["encoder_decoder"]), "a<b", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert stderr.strip() == "error: input 'a<b': symbol '<' is not in the task's alphabet a b c d e f g h i j"


def test_view_prints_its_url_serves_the_api_and_stops_on_ctrl_c(runs):
    process = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "view", str(runs["encoder_decoder"]), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    assert (
        stderr.strip()
        == f"error: {bad}: line 2: this model has no 'self' attention; it has: cross, decoder_self, encoder_self"
    )


def test_view_refuses_a_non_loopback_host_without_allow_host_before_serving(runs, capsys):
    code, stdout, stderr = run_main(["view", str(runs["encoder_decoder"]), "--host", "0.0.0.0", "--port", "0"], capsys)
    assert (code, stdout) == (2, "")
    assert stderr.startswith("error: --host 0.0.0.0 is not a loopback address: ") and "--allow-host NAME" in stderr
    assert stderr.count("\n") == 1


def test_view_refuses_an_allowed_host_that_is_not_a_host_name(runs, capsys):
    code, stdout, stderr = run_main(
        ["view", str(runs["encoder_decoder"]), "--host", "0.0.0.0", "--port", "0", "--allow-host", "box.lan:8765"],
        capsys,
    )
    assert (code, stdout) == (2, "")
    assert (
        stderr.startswith("error: --allow-host 'box.lan:8765': not a host name or IP address")
        and stderr.count("\n") == 1
    )


def _ask(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    # a generous guard, not a timing check: a fresh process's first model run may build the C++ kernels
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        return sock.recv(65536)


def _disconnect_mid_body(port: int) -> None:
    """A POST that announces 100 bytes, sends 2 and disconnects (it printed a ClientDisconnect traceback)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"POST /api/run HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{}"
        )


def _post_closing(port: int, body: bytes) -> tuple[int, dict]:
    """POST with urllib, which sends ``Connection: close`` and its whole body before it reads the
    answer (a body refused unread reached it as a connection reset)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/run", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_served_viewer_answers_bad_bodies_hosts_and_disconnects_keeps_serving_and_prints_no_traceback(runs):
    """The real server (uvicorn) on all interfaces with one allowed name: issue 23's and issue 37's
    probes (400s, a 10 MB body's 413 read by a client that sends it whole first, a client gone
    mid-body)."""
    # PyTorch's attention, not attnlab's C++ kernels: this test is about HTTP, and a fresh process
    # must not wait for a kernel build that another checkout of attnlab may have replaced
    env = {**os.environ, "ATTNLAB_NATIVE": "0"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attnlab",
            "view",
            str(runs["encoder_decoder"]),
            "--port",
            "0",
            "--host",
            "0.0.0.0",
            "--allow-host",
            "viewer.example",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        found = re.search(r"http://0\.0\.0\.0:(\d+)/", line)
        assert found, (line, process.stderr.read() if process.poll() is not None else "")
        port = int(found[1])
        named = {"Host": f"viewer.example:{port}", "Content-Type": "application/json"}
        probes = [
            b"[" * 100_000,
            b"[" * 60_000,
            b"\xff\xfe\x00",
            b'{"text": ',
            b'{"text": ""}',
            b'{"text": 1}',
            b'{"text": "ab", "x": 1}',
            b'{"text": "ab", "off": [{"kind": "cross", "layer": 0.5, "head": 0}]}',
        ]
        for body in probes:
            status, answer = _ask(port, "POST", "/api/run", body, named)
            assert status == 400 and answer["field"], (body[:40], status, answer)
        assert _ask(port, "GET", "/api/model", headers={"Host": "attacker.example"}) == (
            400,
            {
                "error": "this viewer only answers to the host names 127.0.0.1, ::1, localhost, viewer.example",
                "field": "Host",
            },
        )
        chunked = (
            b"POST /api/run HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
        )
        assert _raw(port, chunked).startswith(b"HTTP/1.1 400 ")
        bad_length = (
            b"POST /api/run HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: abc\r\nConnection: close\r\n\r\n{}"
        )
        assert _raw(port, bad_length).startswith(b"HTTP/1.1 400 ")
        _disconnect_mid_body(port)
        assert _post_closing(port, b"x" * 10_000_000) == (
            413,
            {
                "error": f"the request body is 10000000 bytes; the viewer takes at most {MAX_RUN_BODY_BYTES}",
                "field": "body",
            },
        )
        _disconnect_mid_body(port)
        for host in (f"viewer.example:{port}", f"localhost:{port}", f"127.0.0.1:{port}"):
            status, answer = _ask(port, "POST", "/api/run", b'{"text": "abcd"}', {**named, "Host": host})
            assert status == 200 and answer["tokens"] == ["a", "b", "c", "d"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) in (0, 130)
        stderr = process.stderr.read()
        assert "Traceback" not in stderr and "Error" not in stderr, stderr
        assert stderr.startswith("warning: listening on 0.0.0.0: anyone who can reach this machine as viewer.example")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def test_view_refuses_an_importance_file_over_the_cap_before_reading_it(runs, tmp_path, capsys):
    big = tmp_path / "big.csv"
    with big.open("wb") as file:
        file.truncate(MAX_IMPORTANCE_BYTES + 1)  # sparse: nothing to read but its size
    code, stdout, stderr = run_main(["view", str(runs["encoder_decoder"]), "--importance", str(big)], capsys)
    assert (code, stdout) == (2, "")
    assert stderr.strip() == f"error: {big}: larger than {MAX_IMPORTANCE_BYTES} bytes"
