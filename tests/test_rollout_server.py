"""The rollout-server transport: safetensors + JSON over 127.0.0.1, a server process in another interpreter,
errors with the server's traceback, the token, shutdown."""

from __future__ import annotations

import http.client
import sys
import textwrap

import pytest
import torch

from omnirl_core.serving.rollout_server import ServerError, ServerProcess, pack, unpack

SERVER = textwrap.dedent('''
    import torch
    from omnirl_core.serving.rollout_server import serve

    def double(meta, tensors):
        return {"n": meta["n"] * 2, "names": sorted(tensors)}, {k: v * 2 for k, v in tensors.items()}

    def fail(meta, tensors):
        raise ValueError("bad request: " + meta["why"])

    serve({"double": double, "fail": fail})
''')


def test_pack_roundtrip_keeps_json_and_exact_tensors():
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "h": torch.randn(2, dtype=torch.bfloat16)}
    meta, back = unpack(pack({"x": [1, 2.5, "s"], "nested": {"k": None}}, tensors))
    assert meta == {"x": [1, 2.5, "s"], "nested": {"k": None}}
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    assert unpack(pack({}))[1] == {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("srv")
    (directory / "echo_server.py").write_text(SERVER)
    with ServerProcess(sys.executable, "echo_server", cwd=directory, start_timeout_s=120, log_dir=directory) as s:
        yield s


def test_calls_return_tensors_and_json(server):
    x = torch.randn(4, 3)
    meta, out = server.call("double", {"n": 21}, {"x": x})
    assert meta == {"n": 42, "names": ["x"]}
    assert torch.equal(out["x"], x * 2)


def test_a_server_side_error_comes_back_with_its_traceback(server):
    with pytest.raises(ServerError) as info:
        server.call("fail", {"why": "no prompt"})
    assert "ValueError: bad request: no prompt" in info.value.message
    assert any("raise ValueError" in line for line in info.value.details)
    with pytest.raises(ServerError, match="no call 'nope'"):
        server.call("nope")


def test_a_call_without_the_token_is_refused(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/double", body=pack({"n": 1}))
    assert conn.getresponse().status == 403


def test_a_server_that_fails_to_start_says_so_with_its_log(tmp_path):
    (tmp_path / "broken_server.py").write_text("raise SystemExit('engine refused to start: no such model')\n")
    with pytest.raises(ServerError) as info:
        ServerProcess(sys.executable, "broken_server", cwd=tmp_path, start_timeout_s=60, log_dir=tmp_path)
    assert "exited during start" in info.value.message
    assert any("no such model" in line for line in info.value.details)


def test_close_stops_the_process(tmp_path):
    (tmp_path / "echo_server.py").write_text(SERVER)
    s = ServerProcess(sys.executable, "echo_server", cwd=tmp_path, start_timeout_s=120, log_dir=tmp_path)
    s.close()
    assert s.proc.poll() is not None
    with pytest.raises(ServerError, match="not running"):
        s.call("double", {"n": 1})


def test_the_ready_line_is_found_behind_an_engines_stdout_prefix(tmp_path):
    """vLLM wraps sys.stdout and prefixes each line with its worker's name ("(DiffusionWorker pid=...) "):
    the server writes its ready line past the wrapper, and the client finds it anywhere in a line."""
    prefixed = textwrap.dedent('''
        import sys

        class Prefixed:
            def __init__(self, stream):
                self.stream = stream
            def write(self, text):
                return self.stream.write("".join("(Worker pid=1) " + line for line in text.splitlines(True)))
            def __getattr__(self, name):
                return getattr(self.stream, name)

        sys.stdout = Prefixed(sys.stdout)
        print("engine banner")
    ''') + SERVER
    (tmp_path / "prefixed_server.py").write_text(prefixed)
    with ServerProcess(sys.executable, "prefixed_server", cwd=tmp_path, start_timeout_s=60, log_dir=tmp_path) as s:
        assert s.call("double", {"n": 2})[0]["n"] == 4
    assert "(Worker pid=1) engine banner" in s.log_path.read_text()
