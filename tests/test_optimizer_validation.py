"""An optimizer step never writes a non-finite number into the weights: hyperparameters out of range are
refused where they enter (a 400 from ``polyrl serve`` naming the field and its range, a one-line config
error from ``polyrl train`` before any model loads), and a step whose update is not finite anyway applies
nothing (weights and optimizer state unchanged, the client trains on)."""

from __future__ import annotations

import math

import pytest
import tinker
from test_bad_input import BASE, run_all
from test_config import error_of
from test_serve import KEY, Served
from tinker import types
from tinker.types.optimizer import OptimParamsBase


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("optim-store"), "--long-poll", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def service(served):
    return served.sdk(KEY)


def _datum(tokens: list[int]) -> types.Datum:
    n = len(tokens)
    inputs = {"target_tokens": types.TensorData(data=tokens[1:] + tokens[:1], dtype="int64", shape=[n]),
              "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


TOKENS = [5, 9, 13, 21, 34, 55, 8]


def test_a_step_whose_update_is_not_finite_applies_nothing(service, tiny_model_dir):
    """eps=1e-300 is > 0 but is 0 in float32: Adam's first update divides 0 by 0 on LoRA's A matrices
    (their gradient is 0 while B is 0). The step is refused, the weights and the optimizer state stay as
    they were (a sampler answers as before, a full save is accepted), and the client trains on."""
    training = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    before = training.save_weights_and_get_sampling_client("before").compute_logprobs(prompt).result(60)
    training.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.optim_step(types.AdamParams(learning_rate=1e-2, eps=1e-300)).result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User
    assert "optim_step refused" in str(err.value) and "unchanged" in str(err.value), str(err.value)
    after = training.save_weights_and_get_sampling_client("after").compute_logprobs(prompt).result(60)
    assert after == before
    training.save_state("full").result(timeout=60)  # the optimizer state is finite too
    out = training.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
    assert math.isfinite(out.metrics["loss:sum"])
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    out = training.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
    assert math.isfinite(out.metrics["loss:sum"])
    trained = training.save_weights_and_get_sampling_client("trained").compute_logprobs(prompt).result(60)
    assert trained != before and all(math.isfinite(x) for x in trained[1:])


ADAM_CASES = [
    ({"eps": 0.0}, "eps"), ({"eps": -1.0}, "eps"), ({"beta1": 1.5}, "beta1"), ({"beta2": -0.1}, "beta2"),
    ({"weight_decay": -1000.0}, "weight_decay"), ({"weight_decay": 1e308}, "weight_decay"),
    ({"learning_rate": 1e308}, "learning_rate"), ({"grad_clip_norm": -1.0}, "grad_clip_norm"),
]
DIMUON_CASES = [
    ({"grad_clip_norm": -1.0}, "grad_clip_norm"), ({"rank_lr_correction_exponent": 1e308}, "exponent"),
    ({"learning_rate": 1e308}, "learning_rate"), ({"beta1": 1.0}, "beta1"), ({"damping": 0.0}, "damping"),
]


def test_optimizer_params_out_of_range_are_400s_naming_the_field(service, tiny_model_dir):
    """Each bad value is refused with one line naming the field and its range; none reaches the weights,
    and both clients go on training."""
    adam = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=2).result()
    dimuon = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=2,
                                                 optimizer=types.DimuonOptimizerConfig()).result()
    steps = [(adam, types.AdamParams(**{"learning_rate": 1e-2, **values}), field)
             for values, field in ADAM_CASES]
    steps += [(dimuon, OptimParamsBase(type="dimuon", **{"learning_rate": 1e-2, **values}), field)
              for values, field in DIMUON_CASES]
    for client, params, field in steps:
        with pytest.raises(tinker.APIError) as err:
            client.optim_step(params).result(timeout=60)
        message = str(err.value)
        assert field in message and "must be" in message and "Traceback" not in message, (params, message)
        assert len(message) < 400, message
    for client, params in ((adam, types.AdamParams(learning_rate=1e-2)),
                           (dimuon, types.DimuonParams(learning_rate=1e-2))):
        client.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
        client.optim_step(params).result(timeout=60)
        out = client.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
        assert math.isfinite(out.metrics["loss:sum"])


@pytest.mark.parametrize("overrides, key", [
    (["optimizer.eps=0"], "optimizer.eps"),
    (["optimizer.eps=-1"], "optimizer.eps"),
    (["optimizer.beta1=1.5"], "optimizer.beta1"),
    (["optimizer.beta2=1"], "optimizer.beta2"),
    (["optimizer.weight_decay=-1000"], "optimizer.weight_decay"),
    (["learning_rate=1e308"], "learning_rate"),
    (["loss_fn=stable_reinforce", "loss_fn_config.max_ratio=-1"], "loss_fn_config.max_ratio"),
    (["loss_fn=stable_reinforce", "loss_fn_config.kl_coeff=-1"], "loss_fn_config.kl_coeff"),
    (["optimizer.type=dimuon", "optimizer.rank_lr_correction_exponent=1e308"],
     "optimizer.rank_lr_correction_exponent"),
])
def test_config_values_the_engine_refuses_are_config_errors(overrides, key):
    message = error_of(None, overrides, base=BASE)
    assert message.startswith(key) and "must be" in message and len(message) < 200, message


def test_huge_bounds_and_values_are_printed_compactly():
    message = error_of(None, ["limits.max_abs_reward=1.0e+308"], base=BASE)
    assert message.startswith("limits.max_abs_reward") and "1e+300" in message and len(message) < 120, message


def test_polyrl_train_refuses_them_before_the_model_loads(tmp_path):
    """One ``error:`` line and exit 2, for ``--print-config`` and for the run itself (the model named
    does not exist: a check that came after loading it would fail differently)."""
    run = ["train", "--overrides", "model_name=./no-such-model", "environments.arithmetic.num_rollouts=2"]
    run_all([
        ([*run, "optimizer.eps=0", "--print-config"], "optimizer.eps"),
        ([*run, "optimizer.beta1=1.5"], "optimizer.beta1"),
        ([*run, "loss_fn=stable_reinforce", "loss_fn_config.max_ratio=-1"], "loss_fn_config.max_ratio"),
        ([*run, "optimizer.type=dimuon", "optimizer.rank_lr_correction_exponent=1e308"], "exponent"),
        ([*run, "limits.max_abs_reward=1e308", "--print-config"], "1e+300"),
    ], tmp_path)


def test_dimuon_params_take_null_as_the_default_and_refuse_other_types():
    from polyrl.local.optim import DEFAULT_DAMPING, DimuonSettings

    settings = DimuonSettings.of({"type": "dimuon", "learning_rate": 1e-3, "damping": None})
    assert settings.damping == DEFAULT_DAMPING
    for bad in ({"learning_rate": "0.1"}, {"learning_rate": True}, {"learning_rate": 1e-3, "beta1": [0.9]}):
        with pytest.raises(ValueError, match="dimuon_params.* must be"):
            DimuonSettings.of({"type": "dimuon", **bad})
