"""vlm-judge against a misbehaving server (a real HTTP server on 127.0.0.1, see conftest.py). Each fault ends
in a retry or in a clear one-line error within the deadline: never a hang, a silent 0, a leaked key, or an
unbounded read."""

from __future__ import annotations

import base64
import time
import tracemalloc

import numpy as np
import pytest
from omnirl_plugin_vlm_judge.options import VLMJudgeOptions
from omnirl_plugin_vlm_judge.parse import JudgeError
from omnirl_plugin_vlm_judge.reward import VLMJudge

from omnirl_core.rewards.dispatch import RewardError, RewardFn, RewardSet

KEY = "sk-omnirl-Secret-Key"
IMAGE = np.full((3, 8, 8), 0.5, np.float32)


@pytest.fixture
def judge_for(monkeypatch):
    """``judge_for(url, **options)``: a judge with the test key in the environment, closed after the test."""
    monkeypatch.setenv("OMNIRL_JUDGE_API_KEY", KEY)
    judges: list[VLMJudge] = []

    def build(url: str, **options) -> VLMJudge:
        judges.append(VLMJudge(VLMJudgeOptions(url=url, **{"backoff_s": 0.01, "timeout_s": 5.0, **options})))
        return judges[-1]

    yield build
    for judge in judges:
        judge.close()


def _fails(judge: VLMJudge, match: str, within_s: float) -> str:
    start = time.perf_counter()
    with pytest.raises(JudgeError, match=match) as err:
        judge([IMAGE], ["a prompt"])
    elapsed = time.perf_counter() - start
    message = str(err.value)
    assert elapsed < within_s, f"took {elapsed:.2f} s"
    assert KEY not in message and "\n" not in message and message.startswith("vlm-judge: ")
    return message


def test_slow_but_within_the_deadline(fake_judge, judge_for):
    server = fake_judge()
    server.mode, server.latency_s = "slow", 0.5
    assert judge_for(server.url, timeout_s=3)([IMAGE], ["p"]) == [0.7]


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_statuses_are_retried(fake_judge, judge_for, status):
    server = fake_judge()
    server.mode, server.fail_first, server.fail_status = "fail-then-ok", 2, status
    assert judge_for(server.url, retries=2)([IMAGE], ["p"]) == [0.7]
    assert len(server.requests) == 3


def test_always_500_fails_after_the_retries(fake_judge, judge_for):
    server = fake_judge()
    server.mode = "always-500"
    message = _fails(judge_for(server.url, retries=2), "failed 3 time\\(s\\), last: HTTP 500", 5)
    assert server.url in message and "raise retries" in message and "Bearer **********" in message
    assert len(server.requests) == 3


def test_a_refused_connection_is_retried_then_reported(judge_for):
    message = _fails(judge_for("http://127.0.0.1:9/v1", retries=1), "cannot reach", 5)
    assert "http://127.0.0.1:9/v1/chat/completions" in message and "Cannot connect" in message


@pytest.mark.parametrize(("mode", "match"), [
    ("garbage", "a body that is not JSON \\('<html><body>502"),
    ("malformed", "unusable reply .* no 'choices' list"),
    ("no-choices", "expected 1 choice, got 0"),
    ("two-choices", "expected 1 choice, got 2"),
])
def test_unusable_replies_are_errors_not_retried(fake_judge, judge_for, mode, match):
    server = fake_judge()
    server.mode = mode
    _fails(judge_for(server.url), match, 5)
    assert len(server.requests) == 1


def test_a_non_number_score_is_an_error_not_a_score(fake_judge, judge_for):
    server = fake_judge()
    server.content = '{"score": true}'
    _fails(judge_for(server.url, parse="json"), "'score' is bool", 5)
    server.content = '{"score": "0.18"}'
    _fails(judge_for(server.url, parse="json"), "'score' is str", 5)
    server.content = "NaN"
    _fails(judge_for(server.url), "no number in the reply", 5)


@pytest.mark.parametrize("mode", ["trickle", "trickle-headers"])
def test_a_trickling_server_fails_at_the_deadline(fake_judge, judge_for, mode):
    server = fake_judge()
    server.mode, server.trickle_s = mode, 1.5  # one byte every 1.5 s: each read alone would be in time
    start = time.perf_counter()
    message = _fails(judge_for(server.url, timeout_s=2.0, retries=2), "no complete reply .* within timeout_s=2 s",
                     3.0)
    assert time.perf_counter() - start >= 1.9
    assert len(server.requests) == 1  # a missed deadline is not retried
    assert "raise timeout_s" in message


def test_a_redirect_is_an_error_and_the_key_never_reaches_the_other_origin(fake_judge, judge_for):
    other = fake_judge()  # another origin (another port), recording what it receives
    server = fake_judge()
    server.mode, server.location = "redirect", f"http://user:pw@127.0.0.1:{other.server.server_address[1]}/steal"
    message = _fails(judge_for(server.url), "answered HTTP 302, a redirect to", 5)
    assert f"http://***@127.0.0.1:{other.server.server_address[1]}/steal" in message and ":pw@" not in message
    assert "never followed" in message
    assert server.auth_headers == [f"Bearer {KEY}"]
    assert other.requests == []  # never contacted, let alone with the Authorization header


@pytest.mark.parametrize("mode", ["huge", "huge-declared"])
def test_a_huge_body_is_not_read(fake_judge, judge_for, mode):
    server = fake_judge()
    server.mode = mode
    tracemalloc.start()
    try:
        _fails(judge_for(server.url, max_response_bytes=1 << 20), "max_response_bytes=1048576", 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    time.sleep(0.2)  # the server notices the hang-up
    assert server.bytes_sent < server.huge // 2


@pytest.mark.parametrize("mode", ["echo", "echo-reply"])
def test_the_key_is_redacted_when_the_server_echoes_it(fake_judge, judge_for, mode, caplog):
    server = fake_judge()
    server.mode = mode
    message = _fails(judge_for(server.url), "HTTP 401|quoted the API key back", 5)
    assert ("**********" if mode == "echo" else "no score is read from such a reply") in message
    assert server.auth_headers == [f"Bearer {KEY}"]  # the key was sent, and echoed, yet not shown
    assert KEY not in caplog.text


def test_a_retried_echo_is_redacted_in_the_log_too(fake_judge, judge_for, caplog):
    server = fake_judge()
    server.mode, server.fail_first, server.fail_status = "fail-then-ok", 1, 503  # its 503 body quotes the key
    server.content = "8"
    assert judge_for(server.url)([IMAGE], ["p"]) == [0.8]
    assert "retrying" in caplog.text and "request had Bearer **********" in caplog.text
    assert KEY not in caplog.text


def test_failures_reach_the_core_as_errors_never_as_zero(fake_judge, judge_for):
    server = fake_judge()
    server.mode = "always-500"
    judge = judge_for(server.url, retries=0)
    required = RewardSet([RewardFn("vlm-judge", judge)])
    from omnirl_core.contracts import GenRequest, RolloutPlan, Sample

    plan = RolloutPlan(step_kinds=("ode",), train_steps=())
    request = GenRequest(uid=0, prompt="p", prompt_index=0, group=0, seed=0, height=8, width=8, plan=plan)
    with pytest.raises(RewardError, match="Required reward 'vlm-judge' failed.*: JudgeError: vlm-judge: "):
        required.score([Sample(request=request, latents=None, sigmas=None, logprobs=None, output=IMAGE)])
    optional = RewardSet([RewardFn("vlm-judge", judge, required=False), RewardFn("one", lambda o, p: [1.0])])
    sample = Sample(request=request, latents=None, sigmas=None, logprobs=None, output=IMAGE)
    optional.score([sample])  # an optional reward that fails is left out, never scored 0
    assert sample.rewards == {"one": 1.0} and sample.reward == 1.0


ODD_KEY = "sk-omnirl/Secret+Key=9"  # characters that percent-encoding changes, and a digit a parser could take
ECHOES = {
    "raw": lambda a: a,
    "percent-encoded, upper-case hex": lambda a: a.replace("/", "%2F").replace("+", "%2B").replace("=", "%3D"),
    "percent-encoded, lower-case hex": lambda a: a.replace("/", "%2f").replace("+", "%2b").replace("=", "%3d"),
    "every byte percent-encoded": lambda a: "".join(f"%{b:02X}" for b in a.encode()),
    "every byte percent-encoded, lower case": lambda a: "".join(f"%{b:02x}" for b in a.encode()),
    "form-encoded": lambda a: a.replace(" ", "+").replace("/", "%2F").replace("+K", "%2BK").replace("=", "%3D"),
    "base64 of the header": lambda a: base64.b64encode(a.encode()).decode(),
    "base64 of the key after a prefix": lambda a: base64.b64encode(("xx:" + a[7:]).encode()).decode(),
    "URL-safe base64": lambda a: base64.urlsafe_b64encode(("x" + a[7:]).encode()).decode(),
    "JSON unicode escapes": lambda a: "".join(f"\\u{ord(c):04x}" for c in a),
    "lower-cased": lambda a: a.lower(),
    "HTML character references": lambda a: "".join(f"&#{ord(c)};" for c in a),
}


@pytest.mark.parametrize("echo", list(ECHOES))
def test_the_key_is_redacted_in_every_encoding_a_server_echoes(fake_judge, judge_for, monkeypatch, echo, caplog):
    """Before, only the raw, JSON-escaped and ``quote(key, safe="")`` forms were masked: lower-case or
    every-byte percent-encoding, base64 and the rest went out as they came."""
    monkeypatch.setenv("OMNIRL_JUDGE_API_KEY", ODD_KEY)
    server = fake_judge()
    server.mode = "echo-raw"  # the body as the test writes it: {"error": "invalid credentials: <echo>"}
    server.echo = lambda auth: '{"error": "invalid credentials: ' + ECHOES[echo](auth) + '"}'
    message = _fails(judge_for(server.url), "HTTP 401", 5)
    assert "**********" in message, message
    echoed = ECHOES[echo](f"Bearer {ODD_KEY}")
    piece = echoed[len(echoed) * 3 // 5:][:8]  # within the key's part of the echo
    assert ODD_KEY not in message and piece not in message, message
    assert server.auth_headers == [f"Bearer {ODD_KEY}"]
    assert ODD_KEY not in caplog.text


def test_no_score_is_read_from_a_reply_that_quotes_the_key(fake_judge, judge_for, monkeypatch):
    """Before: 'I was called with Bearer sk-omnirl/Secret+Key=9' scored 0.9 (the digit of the key)."""
    monkeypatch.setenv("OMNIRL_JUDGE_API_KEY", ODD_KEY)
    server = fake_judge()
    server.mode = "echo-reply"
    for echo in ("raw", "every byte percent-encoded, lower case", "base64 of the header"):
        server.echo = ECHOES[echo]
        message = _fails(judge_for(server.url), "quoted the API key back in its reply; no score is read", 5)
        assert ODD_KEY not in message


PREFIX = '{"error": {"message": "invalid credentials: Bearer '  # what the body holds before the key


@pytest.mark.parametrize(("pad", "where"), [("x" * (191 - len(PREFIX)), "cut at 200 characters"),
                                             (" " * (4096 - 9 - len(PREFIX)), "cut at the 4 KiB read")])
def test_a_key_cut_in_two_by_the_message_limits_is_not_shown_in_part(fake_judge, judge_for, pad, where):
    """Before, the message was shortened first and masked after: the piece of the key before the cut was shown."""
    server = fake_judge()
    server.mode, server.echo = "echo", lambda auth: pad + auth
    message = _fails(judge_for(server.url), "HTTP 401", 5)
    assert not any(KEY[:n] in message for n in range(6, len(KEY) + 1)), (where, message)
