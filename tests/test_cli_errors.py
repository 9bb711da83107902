"""Bad input: a clear message, the right exit code, and no traceback (without --debug)."""

from pathlib import Path

from .conftest import run_cli

FIXTURES = str(Path(__file__).parent / "fixture_plugins")
BASE = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny"]


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr


def test_unknown_model_suggests_the_close_name():
    proc = run_cli("train", "--model", "qwen-imgae", "--algo", "flowgrpo", "--dry-run")
    assert proc.returncode == 3
    assert "Unknown model 'qwen-imgae'. Did you mean 'qwen-image'?" in proc.stderr
    assert "pip install omnirl-plugin-" in proc.stderr
    _no_traceback(proc)


def test_unknown_algorithm_suggests_the_close_name():
    proc = run_cli("train", "--model", "qwen-image", "--algo", "flowgrop", "--dry-run")
    assert proc.returncode == 3 and "Did you mean 'flowgrpo'?" in proc.stderr
    _no_traceback(proc)


def test_unknown_config_key_is_a_usage_error_with_did_you_mean():
    proc = run_cli(*BASE, "--set", "train.learning_rate=1e-3", "--dry-run")
    assert proc.returncode == 2
    assert "train.learning_rate: unknown key" in proc.stderr
    _no_traceback(proc)
    proc = run_cli(*BASE, "--set", "algorithm.options.clip_rnage=1e-3", "--dry-run")
    assert proc.returncode == 2 and "Did you mean 'clip_range'?" in proc.stderr


def test_invalid_value_negative_steps():
    proc = run_cli(*BASE, "--steps", "-5", "--dry-run")
    assert proc.returncode == 2
    assert "run.steps" in proc.stderr and "greater than or equal to 1" in proc.stderr
    _no_traceback(proc)


def test_capability_mismatch_names_what_is_missing_and_who_has_it():
    proc = run_cli("train", "--model", "ode-only", "--algo", "flowgrpo", "--dry-run",
                   env={"PYTHONPATH": FIXTURES, "OMNIRL_PLUGINS": "toy_plugin"})
    assert proc.returncode == 3
    assert "cannot train model 'ode-only': the model lacks sde-logprob" in proc.stderr
    assert "qwen-image" in proc.stderr  # a model that has it
    _no_traceback(proc)


def test_a_third_party_duplicate_name_never_breaks_the_first_party_one():
    # toy_plugin registers a reward called 'jpeg' too: the unqualified name keeps meaning omnirl's own
    proc = run_cli(*BASE, "--reward", "jpeg", "--dry-run", env={"PYTHONPATH": FIXTURES,
                                                                 "OMNIRL_PLUGINS": "toy_plugin"})
    assert proc.returncode == 0, proc.stderr
    assert "also provided by toy_plugin:jpeg; using omnirl's own (jpeg:jpeg)" in proc.stderr
    assert "- jpeg x1.0" in proc.stdout
    theirs = run_cli(*BASE, "--reward", "toy_plugin:jpeg", "--dry-run", env={"PYTHONPATH": FIXTURES,
                                                                              "OMNIRL_PLUGINS": "toy_plugin"})
    assert theirs.returncode == 0, theirs.stderr
    ok = run_cli(*BASE, "--reward", "jpeg:jpeg:2.0", "--dry-run", env={"PYTHONPATH": FIXTURES,
                                                                        "OMNIRL_PLUGINS": "toy_plugin"})
    assert ok.returncode == 0, ok.stderr
    assert "jpeg:jpeg x2.0" in ok.stdout


def test_missing_recipe_and_bad_preset():
    proc = run_cli(*BASE, "--recipe", "/nonexistent.yaml", "--dry-run")
    assert proc.returncode == 2 and "Recipe '/nonexistent.yaml' not found" in proc.stderr
    proc = run_cli("train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "huge", "--dry-run")
    assert proc.returncode == 2 and "no preset 'huge'" in proc.stderr


def test_output_dir_holding_a_different_run(tmp_path: Path):
    out = tmp_path / "run"
    first = run_cli(*BASE, "--steps", "1", "--output-dir", str(out))
    assert first.returncode == 0, first.stderr
    proc = run_cli(*BASE, "--steps", "1", "--output-dir", str(out), "--set", "train.lr=0.5")
    assert proc.returncode == 2
    assert "holds a different run" in proc.stderr and "train.lr" in proc.stderr
    _no_traceback(proc)
    # an option the saved run does not have is a difference too: the run would not resume exactly
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    del saved["train"]["rs_fallback"]
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    proc = run_cli(*BASE, "--steps", "2", "--output-dir", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "train.rs_fallback: absent (saved) vs 0.05 (now)" in proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    proc = run_cli(*BASE, "--steps", "1", "--output-dir", str(foreign), "--dry-run")
    assert proc.returncode == 2 and "holds no omnirl run" in proc.stderr


def test_unreachable_model_path_is_a_clear_error(tmp_path: Path):
    proc = run_cli("train", "--model", "qwen-image", "--algo", "flowgrpo", "--steps", "1",
                   "--set", f"model.path={tmp_path / 'missing'}", "--output-dir", str(tmp_path / "r"),
                   "--set", "rollout.height=32", "--set", "rollout.width=32")
    assert proc.returncode == 2
    assert "not a diffusers Qwen-Image directory" in proc.stderr
    _no_traceback(proc)


def test_debug_shows_the_traceback():
    proc = run_cli("--debug", "train", "--model", "qwen-imgae", "--algo", "flowgrpo", "--dry-run")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_dry_run_prints_the_plan_without_a_device():
    proc = run_cli(*BASE, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "samples_per_step: 32" in proc.stdout and "algorithm: qwen-image" not in proc.stdout
    assert "flowgrpo" in proc.stdout


def test_usage_errors_exit_2_without_a_traceback():
    proc = run_cli("train", "--bogus")
    assert proc.returncode == 2 and "No such option: --bogus" in proc.stderr
    _no_traceback(proc)
    bare = run_cli()
    assert bare.returncode == 2 and "Usage" in bare.stdout + bare.stderr and "NoArgsIsHelpError" not in bare.stderr
    fmt = run_cli("list", "models", "--format", "xml")
    assert fmt.returncode == 2 and "Unknown --format 'xml'" in fmt.stderr


def test_a_plugin_that_exits_on_import_is_reported_broken_not_fatal():
    proc = run_cli("list", "plugins", env={"PYTHONPATH": FIXTURES, "OMNIRL_PLUGINS": "exiting_plugin"})
    assert proc.returncode == 0, proc.stderr
    assert "exiting_plugin" in proc.stdout and "broken" in proc.stdout and "SystemExit" in proc.stdout
    ok = run_cli(*BASE, "--dry-run", env={"PYTHONPATH": FIXTURES, "OMNIRL_PLUGINS": "exiting_plugin"})
    assert ok.returncode == 0, ok.stderr
