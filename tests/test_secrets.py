"""API keys never leave the process: a real training run whose environment leaks the keys it can
see (in a metric name, a reward, a message, an error) writes them nowhere -- not to stdout or
stderr, the run directory (metrics, trajectories, config, checkpoints, report), the W&B offline
files or the OpenReward uploads."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from polyrl.secrets import MASK

FIXTURES = Path(__file__).parent / "fixtures"
KEYS = {
    "TINKER_API_KEY": "tml-PLANTEDtinker7f3a9c2b",
    "OPENREWARD_API_KEY": "or-PLANTEDopenreward51d2e8",
    "WANDB_API_KEY": "PLANTEDwandb" + "0123456789abcdef0123456789ab",  # 40 characters, as W&B keys are
}


class UploadCapture:
    """OpenReward's platform API on 127.0.0.1, recording every rollout upload's body."""

    def __init__(self):
        import uvicorn

        self.bodies: list[bytes] = []
        app = FastAPI()

        @app.get("/{path:path}")
        async def lookup(path: str):
            return [] if path.endswith("/variants") else {"id": "env_leaky"}

        @app.post("/{path:path}")
        async def record(path: str, request: Request):
            self.bodies.append(await request.body())
            return {"ok": True}

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "capture server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def _leaks(data: bytes | str) -> list[str]:
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return [name for name, value in KEYS.items() if value in text]


@pytest.mark.slow
def test_planted_keys_appear_in_no_output_of_a_real_run(tiny_model_dir, tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("openreward")
    capture = UploadCapture()
    config = {
        "model_name": tiny_model_dir, "lora_rank": 4, "batch_size": 2, "max_steps": 2, "max_tokens": 3,
        "save_every": 1, "eval_every": 2, "log_path": "run", "local": {"store_dir": "store"},
        "outputs": {"report": True},
        "wandb_project_name": "polyrl-secrets", "openreward_run_name": "leaky-run",
        "environments": {"leaky": {"type": f"module:{FIXTURES / 'module_leaky_env.py'}", "num_rollouts": 2,
                                   "max_turns": 2, "splits": {"test": {"num_samples": 2}}}},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    env = {**os.environ, **KEYS, "WANDB_MODE": "offline", "OPENREWARD_API_URL": capture.url,
           "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
    env.pop("WANDB_SILENT", None)  # W&B's own console output is an output too
    try:
        proc = subprocess.run([sys.executable, "-m", "polyrl.cli", "train", "--config_path", "run.yaml"],
                              cwd=tmp_path, env=env, capture_output=True, timeout=300)
    finally:
        capture.close()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]

    run = tmp_path / "run"
    # the run did exercise every leak: the key-named metric, the warned-about reward, the error
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("env/leaky/leak_") for r in rows for k in r)
    assert b"is not a number" in proc.stderr
    trajectories = [json.loads(line) for f in sorted((run / "trajectories").glob("*.jsonl"))
                    for line in f.read_text().splitlines()]
    assert any(t["error"] for t in trajectories)
    assert (run / "report" / "index.html").is_file() and list(run.glob("wandb/offline-run-*"))
    assert capture.bodies

    found = {}
    for name, data in [("stdout", proc.stdout), ("stderr", proc.stderr)]:
        if _leaks(data):
            found[name] = _leaks(data)
    for f in [*run.rglob("*"), *(tmp_path / "store").rglob("*")]:
        if f.is_file() and _leaks(f.read_bytes()):
            found[str(f.relative_to(tmp_path))] = _leaks(f.read_bytes())
    for t in trajectories:  # per-token text, read as a whole: the key must not be spelled out there either
        if _leaks("".join(t["token_text"])):
            found[f"token_text of step {t['step']}"] = _leaks("".join(t["token_text"]))
    for i, body in enumerate(capture.bodies):
        if _leaks(body):
            found[f"OpenReward upload {i}"] = _leaks(body)
    assert not found, json.dumps(found, indent=1)


# ---------------------------------------------------------------------------- each sink on its own
SECRET = "tml-unit-planted-6c1f0e"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", SECRET)
    return SECRET


def _captured_log(logger_name: str, emit) -> str:
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_non_numeric_reward_warning_is_redacted(secret):
    from polyrl.envs.module_env import RewardCoercion

    metrics: dict[str, float] = {}
    text = _captured_log("polyrl.envs.module_env",
                         lambda _: RewardCoercion("module:x")({"why": f"key {secret}"}, metrics))
    assert "is not a number" in text and MASK in text and secret not in text
    assert metrics == {"non_numeric_reward": 1.0}


def test_any_log_record_and_its_traceback_are_redacted(secret):
    def emit(logger):
        logger.warning("plain %s and %r", secret, {"k": secret})
        try:
            raise RuntimeError(f"failed with {secret}")
        except RuntimeError:
            logger.exception("while uploading")
        logger.warning("nothing secret here: %d", 3)

    text = _captured_log("some.library", emit)
    assert secret not in text
    assert "plain *** and {'k': '***'}" in text and "RuntimeError: failed with ***" in text
    assert "nothing secret here: 3" in text


def test_python_warnings_are_redacted(secret):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(f"deprecated option with {secret}")
    shown = warnings.formatwarning(caught[0].message, caught[0].category, caught[0].filename,
                                   caught[0].lineno)
    assert MASK in shown and secret not in shown


def test_metric_rows_mask_names_but_keep_numbers_of_secret_sounding_keys(secret, tmp_path):
    from polyrl.tracking.files import RunFiles

    files = RunFiles(tmp_path / "run")
    files.log_metrics({"step": 0, f"env/x/leak_{secret}": 1.0, "env/x/password_correct": 1.0, "note": secret})
    files.log_checkpoint({"name": "final", "batch": 1, "cursors": {"hf_token": 3}})
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row == {"step": 0, "env/x/leak_***": 1.0, "env/x/password_correct": 1.0, "note": MASK}
    assert files.checkpoints()[0]["cursors"] == {"hf_token": 3}  # resume needs every cursor back


def test_trajectory_token_text_does_not_spell_a_secret(secret, tmp_path):
    from polyrl.secrets import redact_pieces
    from polyrl.tracking.files import RunFiles

    pieces = ["key", " is", " tml", "-unit", "-planted", "-6c", "1f0e", ".", " ok"]
    assert redact_pieces(pieces) == ["key", " is", MASK, "", "", "", "", ".", " ok"]
    assert redact_pieces(["a", "b"]) == ["a", "b"]
    files = RunFiles(tmp_path / "run")
    files.log_trajectories(0, [{"step": 0, "messages": [{"role": "user", "content": secret}],
                                "metrics": {f"leak_{secret}": 1.0}, "token_text": pieces,
                               "tokens": list(range(9))}])
    text = (tmp_path / "run" / "trajectories" / "step_000000.jsonl").read_text()
    row = json.loads(text)
    assert secret not in text and secret not in "".join(row["token_text"])
    assert len(row["token_text"]) == len(row["tokens"]) and row["metrics"] == {"leak_***": 1.0}


def test_uncaught_tracebacks_of_the_command_line_are_redacted(secret, monkeypatch, capsys):
    import threading

    from polyrl.secrets import redact_tracebacks

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    redact_tracebacks()
    try:
        raise RuntimeError(f"crashed holding {secret}")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    thread = threading.Thread(target=lambda: (_ for _ in ()).throw(ValueError(f"thread saw {secret}")))
    thread.start()
    thread.join()
    err = capsys.readouterr().err
    assert "RuntimeError: crashed holding ***" in err and "ValueError: thread saw ***" in err
    assert "Traceback" in err and secret not in err
    hook = sys.excepthook
    redact_tracebacks()  # a second main() in the same process does not wrap the hook again
    assert sys.excepthook is hook


# ------------------------------------------------------------------------- literal secrets in configs
LITERALS = {"api_token": "sk-PLANTEDliteral-token", "access_key": "AKIAPLANTEDLITERAL",
            "dbPassword": "hunter2-PLANTED", "headers": {"Authorization": "Bearer PLANTED-bearer",
                                                       "X-Api-Key": "PLANTED-x-api-key"},
            "oauth": {"client_secret": "PLANTED-client-secret"}}
KEPT = {"max_tokens": 7, "num_keys": 3, "key_column": "question", "tokenizer": "plain", "tokens": 5}


def test_literal_secrets_in_config_args_are_masked_wherever_the_config_is_shown(tiny_model_dir, tmp_path):
    """Keys named like a secret in an environment's args (``api_token: sk-...``, not only values of
    environment variables) are masked in ``--print-config``, ``config.json`` and the report's config;
    settings merely named with tokens or keys (``max_tokens``, ``num_keys``, ``key_column``) are kept, and
    the run itself gets every real value."""
    from polyrl.config.files import load_config
    from polyrl.report.data import read_config
    from polyrl.tracking.files import RunFiles

    # a user's own environment, which takes a service's credentials among its args
    (tmp_path / "secret_env.py").write_text("class Game:\n"
                                            "    def initial_observation(self):\n        return 'q'\n\n"
                                            "    def step(self, text):\n        return 0.0\n\n\n"
                                            "def load_environment(**args):\n    return Game()\n")
    base = {"model_name": tiny_model_dir, "environments": {"password_game": {
        "type": f"module:{tmp_path / 'secret_env.py'}", "args": {**LITERALS, **KEPT}}}}
    config = load_config(None, [], base=base)
    assert config.environments["password_game"].args == {**LITERALS, **KEPT}  # what the run uses
    (tmp_path / "run.json").write_text(json.dumps(base))
    shown = subprocess.run([sys.executable, "-m", "polyrl.cli", "train", "--config_path", "run.json",
                            "--print-config"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    RunFiles(tmp_path / "run").write_config(config.dump())
    written = (tmp_path / "run" / "config.json").read_text()
    (tmp_path / "old").mkdir()  # a config.json written unmasked (by an older run) is masked when shown
    (tmp_path / "old" / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    reported = json.dumps(read_config(tmp_path / "old"))
    for text in (shown.stdout, written, reported):
        assert "PLANTED" not in text, text
        assert "question" in text and "plain" in text and "num_keys" in text and "max_tokens" in text
    args = json.loads(written)["environments"]["password_game"]["args"]
    assert args["api_token"] == MASK and args["headers"] == {"Authorization": MASK, "X-Api-Key": MASK}
    assert {k: args[k] for k in KEPT} == KEPT
