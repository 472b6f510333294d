"""Config loading, overrides, one-line errors, .env handling, redaction and the field reference."""

from __future__ import annotations

import json
import os

import pytest

from polyrl.config.files import apply_overrides, load_config, load_dotenv_file, parse_scalar
from polyrl.config.reference import config_reference
from polyrl.config.schema import ConfigError, EnvConfig, TrainConfig
from polyrl.local.losses import policy_gradient_losses
from polyrl.secrets import SECRET_ENV_VARS, redact, redact_text

KNOWN_ENV_TYPES = {"arithmetic", "wordle"}
BASE = {"model_name": "tiny", "environments": {"arithmetic": {}}}


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Run in an empty directory (no stray .env), with no real keys and fixed registries."""
    monkeypatch.chdir(tmp_path)
    for name in (*SECRET_ENV_VARS, "POLYRL_TEST_VAR", "HF_TOKEN"):
        monkeypatch.setenv(name, "placeholder")  # recorded, so monkeypatch restores the original state
        monkeypatch.delenv(name)

    def get_env_builder(type_name: str):
        if type_name not in KNOWN_ENV_TYPES:
            raise KeyError(f"unknown environment type {type_name!r}; known: arithmetic, wordle")
        return object

    import polyrl.envs.registry
    import polyrl.renderers
    import polyrl.renderers.base

    monkeypatch.setattr(polyrl.envs.registry, "get_env_builder", get_env_builder)
    for module in (polyrl.renderers, polyrl.renderers.base):
        monkeypatch.setattr(module, "renderer_names", lambda: ["qwen3", "role_colon"], raising=False)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------- loading


def test_yaml_file_with_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model_name: Qwen/Qwen3-0.6B\n"
        "learning_rate: 2e-5\n"
        "environments:\n"
        "  arithmetic: {num_rollouts: 4, args: {scale: 1e3}}\n"
        "  easy_math: {type: arithmetic, weight: 0.5, splits: {train: {num_samples: 100}}}\n"
    )
    cfg = load_config(path)
    assert cfg.model_name == "Qwen/Qwen3-0.6B"
    assert cfg.learning_rate == 2e-5 and isinstance(cfg.learning_rate, float)
    assert cfg.batch_size == 8 and cfg.backend == "local" and cfg.loss_fn == "importance_sampling"
    arith, easy = cfg.environments["arithmetic"], cfg.environments["easy_math"]
    assert arith.type == "arithmetic" and arith.num_rollouts == 4
    assert arith.args == {"scale": 1000.0}  # untyped args get YAML 1.2-style floats too
    assert arith.splits["train"].shuffle is True and arith.splits["train"].num_samples is None
    assert arith.splits["test"].shuffle is False and arith.splits["test"].num_samples == 32
    assert easy.type == "arithmetic" and easy.weight == 0.5
    assert set(easy.splits) == {"train", "test"} and easy.splits["train"].shuffle is True
    assert easy.splits["test"].num_samples == 32
    assert easy.splits["train"].num_samples == 100
    assert cfg.turn_max_tokens("arithmetic") == 256


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'model_name = "tiny"\nbatch_size = 16\nloss_fn = "ppo"\n'
        "[loss_fn_config]\nclip_low_threshold = 0.8\n"
        "[environments.wordle]\nmax_turns = 6\nmax_tokens = 64\n"
        "[environments.wordle.splits.test]\nnum_samples = 10\n"
    )
    cfg = load_config(path)
    assert cfg.batch_size == 16 and cfg.loss_fn_config == {"clip_low_threshold": 0.8}
    wordle = cfg.environments["wordle"]
    assert wordle.type == "wordle" and wordle.max_turns == 6 and cfg.turn_max_tokens("wordle") == 64
    assert set(wordle.splits) == {"train", "test"} and wordle.splits["test"].num_samples == 10
    assert wordle.splits["test"].shuffle is False


def test_overrides_nested_new_entries_and_scalars(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model_name: tiny\nenvironments:\n  arithmetic: {num_rollouts: 4}\n")
    cfg = load_config(
        path,
        [
            "batch_size=64",
            "learning_rate=2e-5",
            "environments.arithmetic.num_rollouts=8",
            "environments.arithmetic.splits.test=null",
            "environments.more.type=wordle",
            "environments.more.temperature=0.7",
            "environments.more.splits.test.num_samples=5",
            "advantages.normalize_by_std=true",
            "wandb_project_name=2024",
            "renderer=qwen3",
        ],
    )
    assert cfg.batch_size == 64 and cfg.learning_rate == 2e-5
    assert cfg.environments["arithmetic"].num_rollouts == 8
    assert set(cfg.environments["arithmetic"].splits) == {"train"}
    more = cfg.environments["more"]
    assert more.type == "wordle" and more.temperature == 0.7 and more.splits["test"].num_samples == 5
    assert cfg.advantages.normalize_by_std is True
    assert cfg.wandb_project_name == "2024"
    assert cfg.renderer == "qwen3"


def test_path_none_starts_from_base_and_base_is_not_mutated():
    base = {"model_name": "tiny", "environments": {"arithmetic": {"num_rollouts": 2}}}
    cfg = load_config(None, ["environments.arithmetic.num_rollouts=3"], base=base)
    assert cfg.environments["arithmetic"].num_rollouts == 3
    assert base["environments"]["arithmetic"]["num_rollouts"] == 2


def test_parse_scalar():
    assert parse_scalar("1e-4") == 1e-4 and isinstance(parse_scalar("1e-4"), float)
    assert parse_scalar("2e-5") == 2e-5 and isinstance(parse_scalar("2E+5"), float)
    assert parse_scalar("3") == 3 and isinstance(parse_scalar("3"), int)
    assert parse_scalar("0.5") == 0.5
    assert parse_scalar("true") is True and parse_scalar("false") is False
    assert parse_scalar("null") is None and parse_scalar("~") is None
    assert parse_scalar("hello world") == "hello world"
    assert parse_scalar("[1, 2]") == [1, 2]
    assert parse_scalar("'2e-5'") == "2e-5"
    assert parse_scalar("a: b: c") == "a: b: c"  # not valid YAML: kept as text


def test_apply_overrides_copies_and_creates_mappings():
    data = {"a": {"b": 1}, "n": None}
    out = apply_overrides(data, ["a.c.d=x", "n.k=1", "top=2"])
    assert out == {"a": {"b": 1, "c": {"d": "x"}}, "n": {"k": 1}, "top": 2}
    assert data == {"a": {"b": 1}, "n": None}
    with pytest.raises(ConfigError, match=r"a\.b is not a mapping"):
        apply_overrides(data, ["a.b.c=1"])


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["learning_rat=0.1"], "learning_rat: unknown key (did you mean learning_rate?)"),
        (["environments.arithmetic.num_rollout=4"], "environments.arithmetic.num_rollout: unknown key"),
        (["environments.arithmetic.splits.valid.shuffle=true"],
         "environments.arithmetic.splits.valid: Input should be 'train' or 'test'"),
        (["environments.arithmetic.num_rollouts=eight"],
         "environments.arithmetic.num_rollouts: Input should be a valid integer"),
        (["environments.arithmetic.num_rollouts=0"],
         "environments.arithmetic.num_rollouts: Input should be greater than or equal to 1"),
        (["loss_fn=reinforce"], "loss_fn: unknown policy-gradient loss 'reinforce' (known: "
                                f"{', '.join(policy_gradient_losses())})"),
        (["loss_fn=ppo", "loss_fn_config.clip_lo=0.2"], "loss_fn_config.clip_lo: unknown key"),
        (["loss_fn_config.beta=0.1"], "loss_fn_config.beta: only used by loss_fn 'dro'"),
        (["loss_fn=dro", "loss_fn_config.clip_high_threshold=1.2"],
         "loss_fn_config.clip_high_threshold: only used by loss_fn 'cispo', 'gspo', 'ppo', not 'dro'"),
        (["advantages.gamma=0.9"], "advantages.gamma: only used by advantages.estimator 'rebn'"),
        (["advantages.gamma=0"], "advantages.gamma: Input should be greater than 0"),
        (["eval_every=5", "environments.arithmetic.splits.test=null"],
         "eval_every: evaluation needs at least one environment with a test split"),
        (["renderer=nope"], "renderer: unknown renderer 'nope'"),
        (["environments.arithmetic.type=nope"],
         "environments.arithmetic.type: unknown environment type 'nope'"),
        (["environments={}"], "environments: at least one environment is required"),
        (["environments.arithmetic.splits={train: null, test: null}"],
         "environments.arithmetic.splits: at least one split"),
        (["model_name=null"], "model_name: Input should be a valid string"),
        (["model_name=./no-such-model"], "model_name: model './no-such-model': no such model directory"),
        (["local.sampler=vllm", "local.vllm.python=./no/python"],
         "local.vllm.python: vLLM's interpreter ./no/python does not exist, set local.vllm.python"),
        (["local.sampler=vllm", "local.vllm.urls=[localhost:8000]"],
         "local.vllm.urls: not an http(s) URL: 'localhost:8000'"),
        (["local.sampler=fast"], "local.sampler: Input should be 'auto', 'polyrl' or 'vllm'"),
    ],
)
def test_errors_are_one_line_naming_the_key(overrides, expected):
    message = error_of(None, overrides, base=BASE)
    assert message.startswith(expected), message
    assert ";" not in message  # exactly one problem reported


def test_missing_required_field():
    assert error_of(None, base={"environments": {"arithmetic": {}}}) == "model_name: Field required"


def test_several_errors_joined_on_one_line():
    message = error_of(None, ["batch_size=0", "environments.arithmetic.temperature=hot"], base=BASE)
    assert message.startswith("batch_size: Input should be greater than or equal to 1; ")
    assert "environments.arithmetic.temperature: Input should be a valid number" in message


def test_tinker_backend_rules(monkeypatch):
    message = error_of(None, ["backend=tinker"], base=BASE)
    assert message.startswith("backend: 'tinker' needs TINKER_API_KEY")
    assert error_of(None, ["backend=tinker", "base_url=http://localhost:8000", "local.device=cpu"],
                    base=BASE) == (
        "local.device: only used by the local backend, but backend is 'tinker'"
    )
    message = error_of(None, ["backend=tinker", "local.dtype=bfloat16", "local.store_dir=/tmp/x"], base=BASE)
    assert (message.startswith("local.dtype: ")
            and "; local.store_dir: only used by the local backend" in message)
    assert "backend:" in message
    monkeypatch.setenv("TINKER_API_KEY", "tk-0123456789")
    message = error_of(None, ["backend=tinker"], base=BASE)
    assert (message.startswith("backend: TINKER_API_KEY") and "'tml-'" in message
            and "0123456789" not in message)
    monkeypatch.setenv("TINKER_API_KEY", "tml-0123456789")
    assert load_config(None, ["backend=tinker"], base=BASE).backend == "tinker"
    # model names are the service's to resolve: no local directory check for a remote backend
    assert load_config(None, ["backend=tinker", "model_name=./no-such-model"],
                       base=BASE).model_name == "./no-such-model"


def test_a_base_url_without_a_key_is_told_which_key_it_sends(monkeypatch):
    from polyrl.backend import PLACEHOLDER_KEY, placeholder_key_note

    config = load_config(None, ["backend=tinker", "base_url=http://127.0.0.1:8000"], base=BASE)
    note = placeholder_key_note(config)
    assert note is not None and f"sending the key {PLACEHOLDER_KEY!r} to http://127.0.0.1:8000" in note
    assert "set TINKER_API_KEY" in note
    monkeypatch.setenv("TINKER_API_KEY", "tml-0123456789")
    assert placeholder_key_note(config) is None
    assert placeholder_key_note(load_config(None, [], base=BASE)) is None  # the local engine needs no key


def test_tinker_key_from_dotenv(tmp_path):
    (tmp_path / ".env").write_text("TINKER_API_KEY=tml-from-dotenv-file\n")
    assert load_config(None, ["backend=tinker"], base=BASE).backend == "tinker"
    assert os.environ["TINKER_API_KEY"] == "tml-from-dotenv-file"


def test_file_errors(tmp_path):
    assert error_of(tmp_path / "absent.yaml") == f"config file not found: {tmp_path / 'absent.yaml'}"
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model_name: tiny\nenvironments: [a\nbatch_size: 3\n")
    message = error_of(bad_yaml)
    assert message.startswith(f"{bad_yaml}: invalid YAML: line ") and "column" in message
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('model_name = "tiny"\nbatch_size = = 3\n')
    message = error_of(bad_toml)
    assert message.startswith(f"{bad_toml}: invalid TOML: ") and "line 2" in message
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    assert "top level must be a mapping" in error_of(scalar)
    ini = tmp_path / "run.ini"
    ini.write_text("[x]\n")
    assert error_of(ini) == f"{ini}: unsupported config format '.ini' (use .yaml, .yml or .toml)"


def test_override_without_equals():
    assert error_of(None, ["batch_size"], base=BASE) == "override 'batch_size': expected key.path=value"
    assert error_of(None, ["a..b=1"], base=BASE) == "override 'a..b=1': expected key.path=value"


def test_bad_environment_name():
    assert error_of(None, base={"model_name": "x", "environments": {"": {"type": "arithmetic"}}}).startswith(
        "environments: environment name '' must be non-empty"
    )


# -------------------------------------------------------------------------------- .env, secrets


def test_dotenv_does_not_override_existing_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "from-shell")
    (tmp_path / ".env").write_text("OPENAI_API_KEY=from-dotenv\nPOLYRL_TEST_VAR=loaded\n")
    assert load_dotenv_file() is True
    assert os.environ["OPENAI_API_KEY"] == "from-shell"
    assert os.environ["POLYRL_TEST_VAR"] == "loaded"
    assert load_dotenv_file(tmp_path / "missing.env") is False


def test_redact_nested_values_and_sensitive_keys(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdef")
    monkeypatch.setenv("OPENAI_API_KEY", "abc")  # too short to mask safely
    data = {
        "messages": [{"role": "user", "content": "key is wandb-secret-123!"}, ("hf_abcdef", 3)],
        "headers": {"Authorization": "Bearer hf_abcdef", "api_key": 42, "ClientSecret": "x",
                    "user_password": None},
        "accessToken": "t", "hf_token": "t", "max_tokens": 256, "token_ids": [1, 2], "abc": "abc",
    }
    out = redact(data)
    assert out["messages"][0] == {"role": "user", "content": "key is ***!"}
    assert out["messages"][1] == ("***", 3)
    assert out["headers"] == {"Authorization": "Bearer ***", "api_key": "***", "ClientSecret": "***",
                              "user_password": None}
    assert out["accessToken"] == "***" and out["hf_token"] == "***"
    assert out["max_tokens"] == 256 and out["token_ids"] == [1, 2] and out["abc"] == "abc"
    assert data["messages"][0]["content"] == "key is wandb-secret-123!"  # input untouched
    assert redact_text("x wandb-secret-123 y hf_abcdef") == "x *** y ***"


def test_dump_is_json_safe_and_redacted(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-very-secret")
    cfg = load_config(
        None, ["backend=tinker", "environments.arithmetic.args.api_key=k",
               "wandb_run_name=run-tml-very-secret"], base=BASE
    )
    dumped = cfg.dump()
    text = json.dumps(dumped)
    assert "tml-very-secret" not in text
    assert dumped["environments"]["arithmetic"]["args"]["api_key"] == "***"
    assert dumped["wandb_run_name"] == "run-***"
    assert dumped["max_tokens"] == 256 and dumped["environments"]["arithmetic"]["type"] == "arithmetic"
    assert TrainConfig.model_validate({**BASE}).environments["arithmetic"].type == "arithmetic"


# ------------------------------------------------------------------------------------ reference


def test_config_reference_lists_every_field():
    text = config_reference()
    for name in TrainConfig.model_fields:
        assert f"\n{name}  (" in text, name
    for name in EnvConfig.model_fields:
        assert f"\nenvironments.<name>.{name}  (" in text, name
    for name in ("shuffle", "num_samples", "seed"):
        assert f"\nenvironments.<name>.splits.<train|test>.{name}  (" in text, name
    assert "environments.<name>.num_rollouts  (int, >= 1, <= 65536, default 8)" in text
    assert "model_name  (str, required)" in text
    assert TrainConfig.model_fields["eval_every"].description in text.replace("\n    ", " ")


def test_sft_config_checks_the_local_model_too(tmp_path):
    from polyrl.sft import SFTConfig

    missing = str(tmp_path / "missing")
    assert error_of(None, [f"model_name={missing}"], base=BASE, model=SFTConfig) == (
        f"model_name: model {missing!r}: no such model directory")
    (tmp_path / "model").mkdir()
    assert load_config(None, [f"model_name={tmp_path / 'model'}"], base=BASE,
                       model=SFTConfig).model_name.endswith("model")


def test_json_config_is_read_as_json(tmp_path):
    """JSON allows keys of any length (PyYAML refuses simple keys past 1,024 characters) and never reads
    a string as a number or a date; its own mistakes are named as JSON ones."""
    key = "k" * 2000
    data = {"model_name": "tiny", "environments": {"arithmetic": {"args": {key: "2001-01-01", "n": "1e3"}}}}
    (tmp_path / "run.json").write_text(json.dumps(data))
    config = load_config(tmp_path / "run.json")
    assert config.environments["arithmetic"].args == {key: "2001-01-01", "n": "1e3"}
    (tmp_path / "bad.json").write_text('{"model_name": "tiny",\n "environments": {"arithmetic": {}},}\n')
    assert "bad.json: invalid JSON: line 2, column" in error_of(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text('{"model_name": "tiny", '
                                       '"environments": {"arithmetic": {"args": {"x": NaN}}}}')
    assert "invalid JSON: NaN is not a number JSON allows" in error_of(tmp_path / "nan.json")


def test_nonterminal_reward_within_the_reward_bound():
    base = {"model_name": "tiny", "environments": {"arithmetic": {}}}
    message = error_of(None, ["environments.arithmetic.nonterminal_reward=-2e6"], base=base)
    assert message == ("environments.arithmetic.nonterminal_reward: -2e+06 is past "
                       "limits.max_abs_reward=1e+06: every unfinished episode would fail"), message
    assert load_config(None, ["environments.arithmetic.nonterminal_reward=-2e6", "limits.max_abs_reward=1e7"],
                       base=base).limits.max_abs_reward == 1e7


# ------------------------------------------------------------------------ layout: flat keys of old


OLD_FLAT = {  # every key that moved into a sub-model, most with a value other than the default
    "device": "cpu", "dtype": "float32", "store_dir": "store", "micro_batch_tokens": 2048,
    "gradient_checkpointing": True,
    "advantage_estimator": "rebn", "gamma": 0.9, "normalize_advantages_by_std": False,
    "remove_constant_reward_groups": True,
    "kl_penalty_coef": 0.1, "kl_reference": "tinker://ref/sampler_weights/x", "kl_discount_factor": 0.5,
    "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_eps": 1e-6, "weight_decay": 0.01, "grad_clip_norm": 1.0,
    "max_steps_off_policy": 2, "stale_groups": "keep", "stream_minibatches": None,
    "max_abs_reward": 100.0, "max_observation_tokens": 500, "max_observation_bytes": 4000,
    "nonfinite_steps": "skip", "max_no_update_frac": 0.25, "max_no_signal_frac": 0.75, "service_timeout": 30,
    "max_service_recoveries": 1,
    "report": False, "metrics_json": True,
}
NEW_NESTED = {  # the same settings, written as they are now
    "local": {"device": "cpu", "dtype": "float32", "store_dir": "store", "micro_batch_tokens": 2048,
              "gradient_checkpointing": True},
    "advantages": {"estimator": "rebn", "gamma": 0.9, "normalize_by_std": False,
                   "remove_constant_reward_groups": True},
    "kl": {"penalty_coef": 0.1, "reference": "tinker://ref/sampler_weights/x", "discount_factor": 0.5},
    "optimizer": {"beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01, "grad_clip_norm": 1.0},
    "off_policy": {"max_steps": 2, "stale_groups": "keep", "stream_minibatches": None},
    "limits": {"max_abs_reward": 100.0, "max_observation_tokens": 500, "max_observation_bytes": 4000,
               "nonfinite_steps": "skip", "max_no_update_frac": 0.25, "max_no_signal_frac": 0.75,
               "service_timeout": 30, "max_service_recoveries": 1},
    "outputs": {"report": False, "metrics_json": True},
}


def test_old_flat_keys_validate_to_their_new_layout_twin_with_one_warning_each():
    assert set(OLD_FLAT) == set(TrainConfig.RENAMED)  # every moved key is exercised
    old = load_config(None, base={**BASE, **OLD_FLAT})
    new = load_config(None, base={**BASE, **NEW_NESTED})
    assert old.model_dump() == new.model_dump() and new.renamed_warnings == []
    note = "config key {!r} is now {!r}; the old name is accepted until the next release"
    assert sorted(old.renamed_warnings) == sorted(note.format(k, TrainConfig.RENAMED[k]) for k in OLD_FLAT)
    # what the old config said is where the code reads it now
    assert (old.local.store_dir, old.advantages.gamma, old.kl.penalty_coef, old.optimizer.beta1,
            old.off_policy.max_steps, old.limits.max_abs_reward, old.outputs.metrics_json) == (
        "store", 0.9, 0.1, 0.8, 2, 100.0, True)
    # the remaining combination: streaming minibatches (refused with rebn and a KL penalty)
    streamed = load_config(None, ["stream_minibatches=2"], base=BASE)
    assert streamed.off_policy.stream_minibatches == 2 and len(streamed.renamed_warnings) == 1


def test_old_flat_keys_edge_cases():
    # kl_penalty_coef 0 was the old way to say "no KL penalty"
    off = load_config(None, ["kl_penalty_coef=0"], base=BASE)
    assert off.kl is None and off.renamed_warnings == [
        "config key 'kl_penalty_coef' is now 'kl.penalty_coef'; the old name is accepted until the next "
        "release"]
    # a reference without a penalty is a missing penalty now
    assert error_of(None, ["kl_reference=tinker://r/sampler_weights/x"], base=BASE) == (
        "kl.penalty_coef: Field required")
    # a key given both ways is an error naming both, in a file or in overrides
    assert error_of(None, ["device=cpu", "local.device=cuda"], base=BASE) == (
        "local.device: given both as 'device' and as 'local.device' (keep 'local.device')")
    assert error_of(None, ["max_steps_off_policy=1"], base={**BASE, "off_policy": {"max_steps": 2}}) == (
        "off_policy.max_steps: given both as 'max_steps_off_policy' and as 'off_policy.max_steps' (keep "
        "'off_policy.max_steps')")
    # a value no member of a union takes: one reason per member, on one line under the field's own key
    assert error_of(None, ["local.micro_batch_tokens=0"], base=BASE) == (
        "local.micro_batch_tokens: Input should be greater than or equal to 1 or 'auto'")
    assert error_of(None, ["local.micro_batch_tokens=many", "batch_size=0"], base=BASE) == (
        "local.micro_batch_tokens: Input should be a valid integer, unable to parse string as an integer or "
        "'auto'; batch_size: Input should be greater than or equal to 1")
    assert load_config(None, ["local.micro_batch_tokens=8192"], base=BASE).local.micro_batch_tokens == 8192
    assert load_config(None, [], base=BASE).local.micro_batch_tokens == "auto"
    # sft takes the local engine's old keys too
    from polyrl.sft import SFTConfig

    sft = load_config(None, ["device=cpu", "micro_batch_tokens=1024"], base=BASE, model=SFTConfig)
    assert (sft.local.device, sft.local.micro_batch_tokens, len(sft.renamed_warnings)) == ("cpu", 1024, 2)
    # direct construction (tests, scripts) maps the same way
    assert TrainConfig(**BASE, store_dir="s", report=False).local.store_dir == "s"


SEED_YAML = """\
backend: local
base_url: null
model_name: tiny
lora_rank: 16
renderer: qwen3
resume_from: null
loss_fn: ppo
loss_fn_config: {clip_low_threshold: 0.8, clip_high_threshold: 1.2}
batch_size: 4
learning_rate: 1e-5
max_steps: 10
max_tokens: 128
save_every: 5
eval_every: 5
seed: 3
log_path: runs/seed
wandb_project_name: null
wandb_run_name: null
openreward_run_name: null
environments:
  arithmetic: {num_rollouts: 4}
"""


def test_the_seed_yaml_keys_stay_flat_without_warnings(tmp_path):
    (tmp_path / "seed.yaml").write_text(SEED_YAML)
    cfg = load_config(tmp_path / "seed.yaml")
    assert cfg.renamed_warnings == []
    assert (cfg.lora_rank, cfg.loss_fn, cfg.batch_size, cfg.learning_rate, cfg.max_steps, cfg.seed) == (
        16, "ppo", 4, 1e-5, 10, 3)
    assert len(TrainConfig.model_fields) <= 30


def test_the_command_line_warns_about_old_keys_and_prints_the_new_layout(tmp_path, capsys):
    import yaml

    from polyrl.cli import main

    (tmp_path / "old.yaml").write_text("model_name: tiny\nenvironments: {arithmetic: {}}\nstore_dir: store\n")
    with pytest.raises(SystemExit) as done:
        main(["train", "--config_path", "old.yaml", "--overrides", "device=cpu", "--print-config"])
    assert done.value.code == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "warning: config key 'device' is now 'local.device'; the old name is accepted until the next release",
        "warning: config key 'store_dir' is now 'local.store_dir'; the old name is accepted until the next "
        "release",
    ]
    printed = yaml.safe_load(out)
    assert printed["local"]["store_dir"] == "store" and printed["local"]["device"] == "cpu"
    assert not set(printed) & set(TrainConfig.RENAMED)
    (tmp_path / "printed.yaml").write_text(out)
    with pytest.raises(SystemExit):
        main(["train", "--config_path", "printed.yaml", "--print-config"])
    again, err = capsys.readouterr()
    assert yaml.safe_load(again) == printed and err == ""


def test_help_config_describes_every_nested_field():
    text = config_reference()
    joined = text.replace("\n    ", " ")
    for section in ("local", "advantages", "optimizer", "off_policy", "limits", "outputs", "kl"):
        model = TrainConfig.model_fields[section].annotation
        model = next((arg for arg in getattr(model, "__args__", ()) if arg is not type(None)), model)
        for name, field in model.model_fields.items():
            assert f"\n{section}.{name}  (" in text, (section, name)
            assert field.description and field.description in joined, (section, name)  # unbroken words
    assert "local.micro_batch_tokens  (int >= 1 | \"auto\", default \"auto\")" in text
    assert "max_store_bytes  (int | null, >= 1, default null)" in text


def test_a_dump_of_the_flat_layout_reads_back_to_the_same_settings():
    """What ``--print-config`` and ``config.json`` held before the sections existed: every key flat, the
    KL penalty off as ``kl_penalty_coef: 0.0`` beside ``kl_reference: null``."""
    from pathlib import Path

    old = load_config(Path(__file__).parent / "fixtures" / "flat_layout_dump.yaml")
    dumped, default = old.model_dump(), TrainConfig(**BASE).model_dump()
    # the dump holds the default of its day (4096; 'auto' now, which is 4096 on a CPU)
    tokens = [dump["local"].pop("micro_batch_tokens") for dump in (dumped, default)]
    assert tokens == [4096, "auto"]
    assert dumped == default and old.kl is None
    assert len(old.renamed_warnings) == len(TrainConfig.RENAMED)
