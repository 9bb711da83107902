"""vlm-judge: registration, options (secrets never from or into the config), the request it sends, score
parsing, and the stand-in server used by the benchmarks."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from omnirl_plugin_vlm_judge.options import TEMPLATES, VLMJudgeOptions
from omnirl_plugin_vlm_judge.parse import ReplyError, parse_score
from omnirl_plugin_vlm_judge.reward import VLMJudge, chat_completions_url, proxy_for
from omnirl_plugin_vlm_judge.server import make_server
from PIL import Image
from pydantic import ValidationError

from omnirl_core.config import validate_options
from omnirl_core.errors import ConfigError

DARK, BRIGHT = np.zeros((3, 8, 8), np.float32), np.ones((3, 8, 8), np.float32)


def test_importing_the_plugin_loads_neither_torch_nor_an_http_client():
    code = ("import sys, omnirl_plugin_vlm_judge; "
            "print(sorted(m for m in ('torch', 'aiohttp', 'httpx', 'numpy', 'PIL') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registered_with_the_old_name_as_an_alias():
    import omnirl_plugin_vlm_judge

    from omnirl_core.plugins import PluginManager

    manager = PluginManager()
    manager.register(omnirl_plugin_vlm_judge, "vlm-judge")
    spec = manager.resolve("reward", "vlm-judge")
    assert manager.resolve("reward", "http-judge") is spec
    assert spec.resources == {"CPU": 0.1} and spec.modalities == ("image",)
    assert spec.load_factory() is VLMJudge and spec.load_config() is VLMJudgeOptions


# -- options: secrets ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["OMNIRL_JUDGE_API_KEY", "OMNIRL_API_KEY", "OMNIRL_VLLM_TOKEN"])
def test_key_variables_made_for_omnirl_are_accepted(name):
    assert VLMJudgeOptions(api_key_env=name).api_key_env == name


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "OPENAI_API_KEY",
                                  "OMNIRL_PLUGINS", "omnirl_judge_api_key", "HOME", ""])
def test_other_variables_are_refused(name):
    with pytest.raises(ValidationError, match="OMNIRL_\\*_API_KEY or OMNIRL_\\*_TOKEN"):
        VLMJudgeOptions(api_key_env=name)


def _config_error(options: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_options(options, VLMJudgeOptions, "rewards.0.options")
    return err.value.render()


def test_config_errors_never_echo_a_secret():
    # omnirl prints each validation error's input: a literal key, a key pasted into api_key_env and a
    # password in the url must not reach that output
    rendered = _config_error({"api_key": "sk-literal-1234"})
    assert "rewards.0.options.api_key: unknown key" in rendered and "sk-literal-1234" not in rendered
    rendered = _config_error({"api_key_env": "sk-pasted-5678"})
    assert "OMNIRL_*_API_KEY" in rendered and "sk-pasted-5678" not in rendered
    rendered = _config_error({"url": "http://alice:pa55word@judge.example:8000/v1"})
    assert "must not hold credentials" in rendered and "pa55word" not in rendered
    assert "http://***@judge.example:8000/v1" in rendered
    rendered = _config_error({"url": "ftp://alice:pa55word@judge.example/v1"})
    assert "http:// or https://" in rendered and "pa55word" not in rendered


def test_config_show_and_repr_hold_no_secret():
    options = VLMJudgeOptions(url="https://judge.example/v1")
    assert options.model_dump(mode="json")["url"] == "https://judge.example/v1"
    assert set(options.model_dump(mode="json")) == set(VLMJudgeOptions.model_fields)  # no api_key field
    assert "***" in repr(VLMJudgeOptions.model_construct(url="http://a:b@h/v1"))  # never built, but safe


def test_config_show_through_the_cli(tmp_path):
    cli = [sys.executable, "-c", "from omnirl_cli.main import run; run()"]
    env = {"OMNIRL_AUTOLOAD": "0", "PATH": "/usr/bin:/bin",
           "OMNIRL_PLUGINS": "omnirl_plugin_cpu,omnirl_plugin_qwen_image,omnirl_plugin_flowgrpo,"
                             "omnirl_plugin_diffusers,omnirl_plugin_torch,omnirl_plugin_vlm_judge"}
    base = ["config", "show", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny",
            "--reward", "http-judge"]
    shown = subprocess.run([*cli, *base, "--set", "rewards.0.options.url=https://judge.example/v1"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "url: https://judge.example/v1" in shown.stdout and "api_key_env: OMNIRL_JUDGE_API_KEY" in shown.stdout
    refused = subprocess.run([*cli, *base, "--set", "rewards.0.options.url=http://bob:hunter22@judge.example/v1"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert refused.returncode == 2
    assert "must not hold credentials" in refused.stderr and "hunter22" not in refused.stderr + refused.stdout


# -- options: templates --------------------------------------------------------------------------

def test_templates_follow_the_parse_mode():
    assert VLMJudgeOptions().template() == TEMPLATES["pointwise"]
    assert VLMJudgeOptions(parse="yes-logprob").template() == TEMPLATES["yes-no"]
    unified = VLMJudgeOptions(prompt_template="unifiedreward").template()
    assert (unified.score_range, unified.score_prefix) == ((1.0, 5.0), "Final Score:")
    custom = VLMJudgeOptions(prompt_template="Rate {prompt} from 1 to 9.").template()
    assert (custom.score_range, custom.score_prefix) == (None, "")
    assert VLMJudgeOptions(prompt_template="Rate {prompt}.", score_range=(1, 9)).template().score_range == (1, 9)
    with pytest.raises(ValidationError, match="written for parse=yes-logprob"):
        VLMJudgeOptions(prompt_template="yes-no")
    with pytest.raises(ValidationError, match="containing \\{prompt\\}"):
        VLMJudgeOptions(prompt_template="Rate this image.")
    with pytest.raises(ValidationError, match="low < high"):
        VLMJudgeOptions(score_range=(10, 0))
    with pytest.raises(ValidationError, match="parse=number only"):
        VLMJudgeOptions(parse="json", score_prefix="Score:")


def test_endpoint():
    assert chat_completions_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("https://h/x/chat/completions") == "https://h/x/chat/completions"


@pytest.mark.parametrize("variable", ["http_proxy", "HTTP_PROXY", "all_proxy"])
def test_requests_go_through_the_proxy_the_environment_sets(fake_judge, monkeypatch, variable):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    proxy = fake_judge()  # answers a request in the proxy form too (the target's whole URL as the path)
    monkeypatch.setenv(variable, proxy.url.split("/v1")[0])
    judge = VLMJudge(VLMJudgeOptions(url="http://judge.invalid:8000/v1", retries=0))  # no such host: only the proxy
    try:
        assert judge([np.full((3, 8, 8), 0.5, np.float32)], ["a prompt"]) == [pytest.approx(0.7)]
    finally:
        judge.close()
    assert [r["path"] for r in proxy.requests] == ["http://judge.invalid:8000/v1/chat/completions"]
    monkeypatch.setenv("no_proxy", "judge.invalid")
    assert proxy_for("http://judge.invalid:8000/v1") is None


# -- the request -----------------------------------------------------------------------------------

def test_request_is_an_openai_chat_completion_with_a_png_data_url(fake_judge, monkeypatch):
    judge_server = fake_judge()
    monkeypatch.setenv("OMNIRL_TEST_API_KEY", "sk-omnirl-test")
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, model="Qwen/Qwen2.5-VL-3B-Instruct", max_tokens=16,
                                     api_key_env="OMNIRL_TEST_API_KEY"))
    try:
        assert judge([np.full((3, 4, 6), 0.5, np.float32)], ["a red apple"]) == [0.7]
    finally:
        judge.close()
    request = judge_server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["authorization"] == "Bearer sk-omnirl-test"
    body = request["body"]
    assert (body["model"], body["temperature"], body["max_tokens"], body["n"]) == \
        ("Qwen/Qwen2.5-VL-3B-Instruct", 0.0, 16, 1)
    [message] = body["messages"]
    image, text = message["content"]
    assert message["role"] == "user" and image["type"] == "image_url" and text["type"] == "text"
    assert "a red apple" in text["text"] and "{prompt}" not in text["text"]
    prefix = "data:image/png;base64,"
    assert image["image_url"]["url"].startswith(prefix)
    png = Image.open(io.BytesIO(base64.b64decode(image["image_url"]["url"][len(prefix):])))
    assert png.size == (6, 4) and np.asarray(png.convert("RGB"))[0, 0].tolist() == [128, 128, 128]
    assert "sk-omnirl-test" not in repr(judge) and "OMNIRL_TEST_API_KEY" in repr(judge)


def test_jpeg_images_on_request(fake_judge):
    judge_server = fake_judge()
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, image_format="jpeg", jpeg_quality=90))
    try:
        judge([np.full((3, 16, 24), 0.25, np.float32)], ["a red apple"])
    finally:
        judge.close()
    url = judge_server.requests[0]["body"]["messages"][0]["content"][0]["image_url"]["url"]
    prefix = "data:image/jpeg;base64,"
    assert url.startswith(prefix)
    jpeg = Image.open(io.BytesIO(base64.b64decode(url[len(prefix):])))
    assert jpeg.format == "JPEG" and jpeg.size == (24, 16)
    assert abs(float(np.asarray(jpeg.convert("RGB"), np.float32).mean()) - 64) <= 2  # lossy, near 0.25 * 255
    with pytest.raises(ValidationError, match="image_format"):
        VLMJudgeOptions(image_format="webp")


def test_no_key_without_the_variable_and_yes_logprob_request(fake_judge, monkeypatch):
    judge_server = fake_judge()
    monkeypatch.delenv("OMNIRL_JUDGE_API_KEY", raising=False)
    judge_server.content = "Yes"
    judge_server.logprobs = {"content": [{"token": "Yes", "logprob": -0.5,
                                          "top_logprobs": [{"token": "Yes", "logprob": -0.5},
                                                           {"token": "No", "logprob": -1.0}]}]}
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, parse="yes-logprob", top_logprobs=7))
    try:
        [score] = judge([DARK], ["a cat"])
    finally:
        judge.close()
    assert score == pytest.approx(np.exp(-0.5) / (np.exp(-0.5) + np.exp(-1.0)))
    body = judge_server.requests[0]["body"]
    assert judge_server.auth_headers == [None]
    assert (body["logprobs"], body["top_logprobs"], body["max_tokens"]) == (True, 7, 1)


def test_a_batch_is_judged_with_up_to_concurrency_requests_at_once(fake_judge):
    judge_server = fake_judge()
    judge_server.mode, judge_server.latency_s = "slow", 0.3
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, concurrency=4))
    try:
        scores = judge([DARK] * 8, ["p"] * 8)
    finally:
        judge.close()
    assert scores == [0.7] * 8 and len(judge_server.requests) == 8
    assert judge_server.max_in_flight == 4


def test_submit_returns_at_once_and_overlapping_batches_share_the_concurrency(fake_judge):
    """What the Ray reward actor awaits: two batches submitted back to back are judged together, within the
    judge's one bound on requests in flight; a batch's error comes with its future."""
    judge_server = fake_judge()
    judge_server.mode, judge_server.latency_s = "slow", 1.5  # the second batch starts well within it, under load
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, concurrency=3))
    try:
        first = judge.submit([DARK] * 2, ["a", "b"])
        second = judge.submit([DARK] * 2, ["c", "d"])
        assert not first.done() and not second.done()  # submit never waits for the judge
        assert first.result(20) == second.result(20) == [0.7, 0.7]
        assert judge_server.max_in_flight == 3  # the second batch started before the first ended
        refused = judge.submit([DARK], ["a", "b"])
        with pytest.raises(Exception, match="got 1 outputs but 2 prompts"):
            refused.result(5)
        assert judge.submit([], []).result(5) == []
    finally:
        judge.close()


def test_the_judge_is_shared_by_reward_threads(fake_judge):
    judge_server = fake_judge()
    judge = VLMJudge(VLMJudgeOptions(url=judge_server.url, concurrency=2))
    results: list[list[float]] = []
    threads = [threading.Thread(target=lambda: results.append(judge([DARK, BRIGHT], ["a", "b"]))) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    finally:
        judge.close()
    assert results == [[0.7, 0.7]] * 6 and judge_server.max_in_flight <= 2


# -- parsing -----------------------------------------------------------------------------------------

def _reply(content=None, logprobs=None):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                         "finish_reason": "stop"}]}


def _score(reply, **options):
    opts = VLMJudgeOptions(**options)
    return parse_score(reply, opts.parse, opts.template(), opts.score_field)


@pytest.mark.parametrize(("content", "options", "expected"), [
    ("7", {}, 0.7),
    ("Score: 8.5/10", {}, 0.85),
    ("10", {}, 1.0),
    ("  -0  ", {}, 0.0),
    ("1. alignment: good (4)\n2. coherence ok\nFinal Score: 4", {"prompt_template": "unifiedreward"}, 0.75),
    ("final score: 2 (of 5)", {"prompt_template": "unifiedreward"}, 0.25),
    ("It scores 0.18", {"prompt_template": "Rate {prompt} 0-1."}, 0.18),
    ('{"score": 6, "reason": "fine"}', {"parse": "json"}, 0.6),
    ('```json\n{"score": 2.5}\n```', {"parse": "json"}, 0.25),
    ('Here: {"quality": 9} done', {"parse": "json", "score_field": "quality"}, 0.9),
    ('{"score": 0.18}', {"parse": "json", "prompt_template": "Rate {prompt} 0-1 as JSON."}, 0.18),
])
def test_scores_are_parsed(content, options, expected):
    assert _score(_reply(content), **options) == pytest.approx(expected)


@pytest.mark.parametrize(("content", "options", "message"), [
    ("a lovely image", {}, "no number in the reply"),
    ("11", {}, "outside score_range \\[0, 10\\]"),
    ("1e999", {}, "not finite"),
    ("Overall 4", {"prompt_template": "unifiedreward"}, "no 'Final Score:' in the reply"),
    ('{"score": true}', {"parse": "json"}, "'score' is bool"),
    ('{"score": "0.18"}', {"parse": "json"}, "'score' is str"),
    ('{"score": NaN}', {"parse": "json"}, "no valid JSON object"),
    ('{"score": Infinity}', {"parse": "json"}, "no valid JSON object"),
    ('{"score": 1e999}', {"parse": "json"}, "not finite"),
    ('{"score": null}', {"parse": "json"}, "'score' is NoneType"),
    ('{"rating": 3}', {"parse": "json"}, "no 'score' field \\(fields: rating\\)"),
    ("[7]", {"parse": "json"}, "no JSON object"),
    ("seven", {"parse": "json"}, "no JSON object"),
])
def test_unusable_scores_are_errors(content, options, message):
    with pytest.raises(ReplyError, match=message):
        _score(_reply(content), **options)


def test_a_reply_cut_at_max_tokens_says_so():
    reply = _reply("Let me think about alignment first")
    reply["choices"][0]["finish_reason"] = "length"
    with pytest.raises(ReplyError, match="cut at max_tokens"):
        _score(reply)


def _top(*pairs):
    return {"content": [{"token": pairs[0][0], "logprob": pairs[0][1],
                         "top_logprobs": [{"token": t, "logprob": lp} for t, lp in pairs]}]}


def test_yes_logprob():
    score = _score(_reply("yes", _top(("yes", -0.2), (" Yes", -2.0), ("no", -1.5), ("maybe", -3.0))),
                   parse="yes-logprob")
    p_yes, p_no = np.exp(-0.2) + np.exp(-2.0), np.exp(-1.5)
    assert score == pytest.approx(p_yes / (p_yes + p_no))
    assert _score(_reply("No", _top(("No", -0.01))), parse="yes-logprob") == 0.0
    for logprobs, message in [
        (None, "no choices\\[0\\].logprobs.content"),
        ({"content": []}, "no choices\\[0\\].logprobs.content"),
        (_top(("maybe", -0.1), ("perhaps", -2.0)), "neither 'yes' nor 'no'"),
        (_top(("yes", True)), "is bool"),
        (_top(("yes", "-0.1")), "is str"),
        (_top(("yes", 0.5)), "positive"),
        ({"content": [{"token": "yes", "logprob": -0.1}]}, "no top_logprobs list"),
    ]:
        with pytest.raises(ReplyError, match=message):
            _score(_reply("yes", logprobs), parse="yes-logprob")


@pytest.mark.parametrize(("reply", "message"), [
    ([1, 2], "a JSON list, not an object"),
    ({"object": "chat.completion"}, "no 'choices' list"),
    ({"error": {"message": "model not found"}}, "no 'choices' list \\(error: .*model not found"),
    ({"choices": []}, "expected 1 choice, got 0"),
    ({"choices": [_reply("7")["choices"][0]] * 2}, "expected 1 choice, got 2"),
    ({"choices": [{"message": {"content": None}}]}, "content is missing"),
])
def test_malformed_replies_are_errors(reply, message):
    with pytest.raises(ReplyError, match=message):
        _score(reply)


# -- the stand-in server ------------------------------------------------------------------------------

@pytest.mark.parametrize("parse", ["number", "json", "yes-logprob"])
def test_stand_in_server_scores_brightness(parse, monkeypatch):
    monkeypatch.setenv("OMNIRL_TEST_API_KEY", "k3y")
    server = make_server(0, api_key="k3y")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    judge = VLMJudge(VLMJudgeOptions(url=f"http://127.0.0.1:{server.server_address[1]}/v1", parse=parse,
                                     api_key_env="OMNIRL_TEST_API_KEY"))
    try:
        scores = judge([DARK, np.full((3, 8, 8), 0.5, np.float32), BRIGHT], ["a", "b", "c"])
    finally:
        judge.close()
        server.shutdown()
        server.server_close()
    assert scores == pytest.approx([0.0, 128 / 255, 1.0], abs=1e-5)
    assert server.state["requests"] == 3


def test_stand_in_server_command_line():
    proc = subprocess.Popen([sys.executable, "-m", "omnirl_plugin_vlm_judge.server", "--port", "0",
                             "--latency-ms", "20"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("stand-in judge on http://127.0.0.1:")
        judge = VLMJudge(VLMJudgeOptions(url=line.split()[-1], model="stand-in"))
        try:
            assert judge([BRIGHT], ["p"]) == [1.0]
        finally:
            judge.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_pickled_judge_is_rebuilt_from_its_options(monkeypatch):
    import pickle

    monkeypatch.setenv("OMNIRL_JUDGE_API_KEY", "sk-not-in-the-pickle")
    judge = VLMJudge(VLMJudgeOptions(url="http://127.0.0.1:9/v1"))
    data = pickle.dumps(judge)
    assert b"sk-not-in-the-pickle" not in data
    assert pickle.loads(data).options == judge.options
    assert json.loads(judge.request_body("data:image/png;base64,AA==", "p"))["model"] == judge.options.model


def test_redactor_masks_every_form_of_the_key_and_url_credentials():
    from omnirl_plugin_vlm_judge.redaction import Redactor, display_url

    redact = Redactor(['k/e"y 1'])
    echoed = 'raw k/e"y 1, json "k/e\\"y 1", url k%2Fe%22y%201, see http://u:p@h:1/x and https://tok@h/'
    assert redact(echoed) == ('raw **********, json "**********", url **********, see http://***@h:1/x and '
                              'https://***@h/')
    assert display_url("http://u:p@[::1]:8000/v1?q=1") == "http://***@[::1]:8000/v1?q=1"
    assert display_url("https://judge.example/v1") == "https://judge.example/v1"


def test_a_key_over_plain_http_to_another_host_is_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("OMNIRL_JUDGE_API_KEY", "sk-warned")
    VLMJudge(VLMJudgeOptions(url="http://judge.example:8000/v1"))
    VLMJudge(VLMJudgeOptions(url="http://127.0.0.1:8000/v1"))
    VLMJudge(VLMJudgeOptions(url="https://judge.example/v1"))
    warnings = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
    assert warnings == [("vlm-judge sends the API key from OMNIRL_JUDGE_API_KEY over plain http to "
                         "http://judge.example:8000/v1/chat/completions; use https beyond this machine")]


EXIT_WITHOUT_CLOSE = """
import threading
import numpy as np
from omnirl_plugin_vlm_judge.options import VLMJudgeOptions
from omnirl_plugin_vlm_judge.reward import VLMJudge
from omnirl_plugin_vlm_judge.server import make_server

server = make_server(0)
threading.Thread(target=server.serve_forever, daemon=True).start()
judge = VLMJudge(VLMJudgeOptions(url=f"http://127.0.0.1:{server.server_address[1]}/v1"))
print(judge([np.full((3, 8, 8), 0.5, np.float32)], ["p"]), flush=True)
"""


def test_a_process_that_never_closes_the_judge_exits_without_unclosed_session_errors():
    """Nothing closes a reward at the end of a run: every run with vlm-judge ended with aiohttp's "Unclosed
    client session" and "Unclosed connector" errors. The session is now closed at exit (and when the judge is
    garbage collected)."""
    proc = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "[0.5019608]", proc.stderr
    assert "Unclosed" not in proc.stderr, proc.stderr


def test_a_judge_dropped_without_close_closes_its_session(fake_judge):
    import gc

    server = fake_judge()
    judge = VLMJudge(VLMJudgeOptions(url=server.url))
    assert judge([BRIGHT], ["p"]) == [0.7]
    thread = judge._thread
    del judge
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()  # the loop stopped: its session was closed first (see _shut)


def test_stand_in_server_bounds_bodies_as_the_reward_server_does():
    """It shares the reward server's rules (``omnirl_core.rewards.server``); before, Content-Length -1 read the
    stream to its end."""
    import socket

    server = make_server(0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + b"{" * 65536)
            reply = sock.makefile("rb").read()  # the server answers and closes without waiting for the stream's end
        assert reply.startswith(b"HTTP/1.1 400 ") and b"Content-Length '-1' is not a number of bytes" in reply
    finally:
        server.shutdown()
        server.server_close()


# -- editing: the source image goes first ---------------------------------------------------------------------

def test_edit_template_sends_the_source_then_the_result(fake_judge, tmp_path):
    """The ``edit`` template: each request holds the prompt's source image (its record's 'image'), then the edited
    sample, then the instruction; the reward declares the field so that --dry-run checks the data has it."""
    from omnirl_plugin_vlm_judge.options import input_fields

    source = tmp_path / "source.png"
    Image.new("RGB", (10, 6), (0, 0, 255)).save(source)
    judge_server = fake_judge()
    options = VLMJudgeOptions(url=judge_server.url, prompt_template="edit")
    judge = VLMJudge(options)
    assert judge.uses_inputs and not VLMJudge(VLMJudgeOptions()).uses_inputs
    assert input_fields(options) == ("image",) and input_fields(VLMJudgeOptions()) == ()
    try:
        assert judge([np.full((3, 4, 6), 1.0, np.float32)], ["make it red"], inputs=[{"image": str(source)}]) == [0.7]
        with pytest.raises(Exception, match="no source image"):
            judge([BRIGHT], ["make it red"], inputs=[{"answer": "x"}])
    finally:
        judge.close()
    [message] = judge_server.requests[0]["body"]["messages"]
    first, second, text = message["content"]
    pngs = [Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))) for part in (first, second)]
    assert [p.size for p in pngs] == [(10, 6), (6, 4)]  # the source as it is, then the sample
    assert np.asarray(pngs[0].convert("RGB"))[0, 0].tolist() == [0, 0, 255]
    assert "make it red" in text["text"] and "first image is the source" in text["text"]
    assert len(judge_server.requests) == 1  # the record without a source never reached the judge
    own = VLMJudgeOptions(prompt_template="Edit: {prompt}. Score 0-10.", source_image=True, score_range=(0, 10))
    assert own.template().source and input_fields(own) == ("image",)
