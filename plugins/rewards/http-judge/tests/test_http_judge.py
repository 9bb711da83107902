"""The HTTP judge against a real local HTTP server (the stand-in judge of this plugin): JSON protocol,
Bearer key from the environment, retries of transient failures, clear errors, the key redacted."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from omnirl_plugin_http_judge.reward import HTTPJudge, HTTPJudgeOptions, JudgeError
from omnirl_plugin_http_judge.server import make_server


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs):
        server = make_server(0, **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}/score"

    yield start
    for server in servers:
        server.shutdown()


def test_scores_images_with_the_key_from_the_environment(serve, monkeypatch):
    server, url = serve(api_key="s3cret")
    monkeypatch.setenv("MY_JUDGE_KEY", "s3cret")
    judge = HTTPJudge(HTTPJudgeOptions(url=url, api_key_env="MY_JUDGE_KEY"))
    dark, bright = np.zeros((3, 8, 8), np.float32), np.ones((3, 8, 8), np.float32)
    assert judge([dark, bright], ["a", "b"]) == [0.0, 1.0]
    assert server.state["requests"] == 2
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(JudgeError, match="HTTP 401"):
        HTTPJudge(HTTPJudgeOptions(url=url, api_key_env="MY_JUDGE_KEY"))([dark], ["a"])


def test_transient_failures_are_retried_then_reported(serve):
    server, url = serve(fail_first=2)
    image = np.full((3, 4, 4), 0.5, np.float32)
    assert HTTPJudge(HTTPJudgeOptions(url=url, retries=2))([image], ["p"])[0] == pytest.approx(128 / 255)
    assert server.state["requests"] == 3
    _, url = serve(fail_first=5)
    with pytest.raises(JudgeError, match="HTTP 503"):
        HTTPJudge(HTTPJudgeOptions(url=url, retries=1))([image], ["p"])
    with pytest.raises(JudgeError, match="unreachable"):
        HTTPJudge(HTTPJudgeOptions(url="http://127.0.0.1:9/score", retries=0, timeout_s=2))([image], ["p"])


def test_the_key_is_redacted_everywhere():
    options = HTTPJudgeOptions(url="http://127.0.0.1:9/score", api_key="s3cret", retries=0, timeout_s=1)
    assert options.model_dump(mode="json")["api_key"] == "**********"
    judge = HTTPJudge(options)
    assert "s3cret" not in repr(judge) and "s3cret" not in repr(options)
    with pytest.raises(JudgeError) as err:
        judge([np.zeros((3, 4, 4), np.float32)], ["p"])
    assert "s3cret" not in str(err.value)
