"""The registries of losses, advantage estimators and renderers are the one list of each: CONTRIBUTING's
snippets register real parts (run here, then used: the loss through the engine, the estimator through
compute_advantages, the renderer on a conversation), a run config accepts exactly what the registries
hold, and a part without the registry's interface is refused when it is registered."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tinker import types

from polyrl.config.checks import check_config
from polyrl.config.files import load_config
from polyrl.config.reference import config_reference
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.local import ServiceClient, losses
from polyrl.renderers import base as renderers_base
from polyrl.renderers import get_renderer
from polyrl.rl import advantages
from polyrl.rl.episode import Episode

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
BASE = {"model_name": "tiny", "environments": {"arithmetic": {}}}
DECORATORS = {"loss": "@register_loss(", "estimator": "@register_estimator(",
              "renderer": "@register_renderer("}


def snippets() -> dict[str, str]:
    """The fenced python blocks of CONTRIBUTING's "Adding the pluggable parts", by the kind of part each
    registers (one block each)."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Adding the pluggable parts"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    found = {kind: [b for b in blocks if decorator in b] for kind, decorator in DECORATORS.items()}
    assert all(len(b) == 1 for b in found.values()), {kind: len(b) for kind, b in found.items()}
    return {kind: b[0] for kind, b in found.items()}


@pytest.fixture
def registries(monkeypatch):
    """Each registry as it is now, restored after the test (the snippets' parts are registered in copies)."""
    monkeypatch.setattr(losses, "LOSSES", dict(losses.LOSSES))
    monkeypatch.setattr(advantages, "ESTIMATORS", dict(advantages.ESTIMATORS))
    monkeypatch.setattr(renderers_base, "_REGISTRY", dict(renderers_base._REGISTRY))


def run_snippet(kind: str) -> dict:
    """Execute CONTRIBUTING's snippet for ``kind``; the names it defined."""
    namespace: dict = {"__name__": f"contributing_{kind}"}
    exec(compile(snippets()[kind], f"CONTRIBUTING.md ({kind})", "exec"), namespace)
    return namespace


def config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, base=BASE)
    assert "\n" not in str(info.value)
    return str(info.value)


def episode(reward: float, turns: int = 1) -> Episode:
    ep = Episode("e", "train", 0, 0)
    ep.reward, ep.turn_spans = reward, [(i, i + 1) for i in range(turns)]
    return ep


# ---------------------------------------------------------------------------------- the snippets
def test_the_loss_snippet_trains_through_the_engine_and_is_a_loss_fn(registries, tiny_model_dir, tmp_path):
    assert "vanilla_pg" not in losses.LOSSES
    run_snippet("loss")
    spec = losses.get_loss("vanilla_pg")
    assert "vanilla_pg" in losses.policy_gradient_losses()

    # the function itself: value and gradient against -sum A * logp written here
    logprobs = torch.tensor([-0.5, -1.2, -2.0, -0.1], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.0, 1.5, -0.5, 2.0], dtype=torch.float64)
    segments = losses.Segments(torch.tensor([0, 0, 1, 1]), 2)
    value, metrics = spec.fn(logprobs, {"advantages": adv}, segments, {})
    value.backward()
    assert float(value.detach()) == pytest.approx(1.5 * 1.2 - 0.5 * 2.0 + 2.0 * 0.1)
    assert metrics == {"loss:sum": pytest.approx(float(value.detach()))}
    torch.testing.assert_close(logprobs.grad, -adv)

    # through the local engine's forward_backward: the learner's logprobs, weighted by the advantages
    training = ServiceClient(store_dir=tmp_path / "store").create_lora_training_client(
        tiny_model_dir, rank=4, seed=0).result()
    tokens = training.get_tokenizer().encode("User: what is 2 + 2?\n\nAssistant: 4\n\n")
    advantages_T = [0.0] * 8 + [1.0] * (len(tokens) - 9)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
        "advantages": types.TensorData(data=advantages_T, dtype="float32")})
    out = training.forward_backward([datum], "vanilla_pg").result()
    learner = out.loss_fn_outputs[0]["logprobs"].to_torch().double()
    assert out.metrics["loss:sum"] == pytest.approx(-float((torch.tensor(advantages_T) * learner).sum()),
                                                    rel=1e-5)

    # the run config takes it from the registry, and its loss_fn_config keys from its registration
    assert load_config(None, ["loss_fn=vanilla_pg"], base=BASE).loss_fn == "vanilla_pg"
    assert config_error(["loss_fn=vanilla_pg", "loss_fn_config.beta=0.1"]) == (
        "loss_fn_config.beta: only used by loss_fn 'dro', not 'vanilla_pg'")
    assert "vanilla_pg" in config_reference().split("\nloss_fn_config  (")[0].split("\nloss_fn  (")[1]


def test_the_estimator_snippet_gives_leave_one_out_advantages(registries):
    run_snippet("estimator")
    g1 = [episode(1.0), episode(0.0), episode(0.0), episode(1.0, turns=2)]
    g2 = [episode(3.0, turns=3), episode(1.0)]
    got = advantages.compute_advantages([g1, g2], "leave_one_out")
    assert got == [[[1 - 1 / 3], [0 - 2 / 3], [0 - 2 / 3], [1 - 1 / 3] * 2], [[2.0] * 3, [-2.0]]]
    advantages.record_advantages([g1, g2], got)  # the shape the training step records
    assert g2[0].turn_advantages == [2.0, 2.0, 2.0]

    # it declares no settings: normalize_by_std is refused, at config load and when called
    with pytest.raises(ValueError, match="'leave_one_out' does not use normalize_by_std"):
        advantages.compute_advantages([g1], "leave_one_out", normalize_by_std=True)
    config = load_config(None, ["advantages.estimator=leave_one_out", "off_policy.max_steps=1",
                                "off_policy.stream_minibatches=2"], base=BASE)
    assert config.advantages.estimator == "leave_one_out"  # per group: minibatches can be streamed
    assert config_error(["advantages.estimator=leave_one_out", "advantages.normalize_by_std=true"]) == (
        "advantages.normalize_by_std: only used by advantages.estimator 'grpo', not 'leave_one_out' "
        "(leave it at false)")


def test_the_renderer_snippet_renders_a_conversation(registries, tokenizer):
    run_snippet("renderer")
    renderer = get_renderer("transcript", tokenizer)
    conversation = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
    prompt = renderer.initial_prompt(conversation[:1])
    assert renderer.decode(prompt) == "User: What is 2 + 2?\n\nAssistant:"
    tokens, weights = renderer.supervised(conversation)
    assert renderer.decode(tokens) == ("User: What is 2 + 2?\n\nAssistant: 4\n\n"
                                       "User: And 3 + 3?\n\nAssistant: 6\n\n")
    assert tokens[:len(prompt)] == prompt  # a rollout's tokens: never re-rendered
    trained = [t for t, w in zip(tokens, weights) if w == 1.0]
    assert renderer.decode(trained) == " 4\n\n 6\n\n"
    reply = renderer.encode(" 4\n\n")
    assert renderer.parse_response(reply)["content"] == "4"
    assert renderer.stop_sequences() == ["\n\n"]
    assert renderer.decode(renderer.continuation(conversation[2:3], assistant_finished=False)) == (
        "\n\nUser: And 3 + 3?\n\nAssistant:")
    assert load_config(None, ["renderer=transcript"], base=BASE).renderer == "transcript"


# ----------------------------------------------------------------------------- the run config
def test_the_config_accepts_what_the_registries_hold_and_names_them_otherwise(registries):
    """An unknown name is one line naming the field and the registry's names; a registered loss that
    takes no advantages (cross_entropy, for supervised data) is not a policy-gradient loss."""
    assert config_error(["advantages.estimator=rloo"]) == "advantages.estimator: unknown advantage " \
        f"estimator 'rloo' (known: {', '.join(sorted(advantages.ESTIMATORS))})"
    assert config_error(["loss_fn=cross_entropy"]).startswith(
        "loss_fn: loss 'cross_entropy' takes no advantages (a policy-gradient loss is one of: ")
    assert config_error(["renderer=transcript"]).startswith(
        "renderer: unknown renderer 'transcript' (known: ")
    # a config built in code meets the same checks once check_config (as train does) sees it
    with pytest.raises(ConfigError, match="^loss_fn: unknown policy-gradient loss 'vanilla_pg'"):
        check_config(TrainConfig(**BASE, loss_fn="vanilla_pg"))
    run_snippet("loss")
    assert check_config(TrainConfig(**BASE, loss_fn="vanilla_pg")).loss_fn == "vanilla_pg"


def test_settings_and_corrections_follow_the_registrations(registries):
    assert config_error(["loss_fn=ppo", "loss_fn_config.tis_cap=2"]) == (
        "loss_fn_config.tis_cap: an off-policy correction's key: set off_policy.correction instead")
    assert config_error(["advantages.gamma=0.5"]) == (
        "advantages.gamma: only used by advantages.estimator 'rebn', not 'grpo' (leave it at 1.0)")
    run_snippet("loss")  # a loss registered without a correction role takes none
    assert config_error(["loss_fn=vanilla_pg", "off_policy.correction=mis"]).startswith(
        "off_policy.correction: loss_fn 'vanilla_pg' takes no off-policy correction (those that do: cispo, ")


# ------------------------------------------------------------------------ refused registrations
def test_an_estimator_of_the_wrong_shape_is_refused_when_registered(registries):
    with pytest.raises(TypeError, match=r"estimator 'per_group_rewards': per_group_rewards\(rewards\) does "
                                        r"not take fn\(episodes_G, \*, gamma, normalize_by_std\)"):
        @advantages.register_estimator("per_group_rewards")
        def per_group_rewards(rewards):
            return rewards
    with pytest.raises(TypeError, match="estimator 'x': uses \\['gama'\\] are not advantages settings"):
        advantages.register_estimator("x", uses=("gama",))
    assert "per_group_rewards" not in advantages.ESTIMATORS


def test_an_estimator_returning_one_number_per_episode_is_named(registries):
    @advantages.register_estimator("flat")
    def flat(episodes_G, *, gamma, normalize_by_std):
        return [[ep.reward for ep in group] for group in episodes_G]

    with pytest.raises(ValueError, match="^advantage estimator 'flat' returned a float for episode 0 of "
                                         "group 0, which has 2 sampled turns"):
        advantages.compute_advantages([[episode(1.0, turns=2)]], "flat")


def test_a_loss_or_renderer_without_the_interface_is_refused_when_registered(registries):
    with pytest.raises(TypeError, match=r"loss 'two_args': two_args\(logprobs, inputs\) cannot be called as "
                                        r"fn\(logprobs, inputs, segments, config\)"):
        @losses.register_loss("two_args", inputs=("target_tokens", "advantages"))
        def two_args(logprobs, inputs):
            return -logprobs.sum(), {}
    with pytest.raises(TypeError, match="config_keys \\['tis_cap'\\] are the off-policy corrections' keys"):
        losses.register_loss("clash", inputs=("target_tokens",), config_keys=("tis_cap",))
    with pytest.raises(TypeError, match="renderer 'half': Half does not define continuation, parse_response"):
        @renderers_base.register_renderer("half")
        class Half(renderers_base.Renderer):
            def initial_prompt(self, messages, tools=None):
                return []

            def stop_sequences(self):
                return []

            def supervised(self, messages, tools=None):
                return [], []
    assert "two_args" not in losses.LOSSES and "half" not in renderers_base.renderer_names()


def test_the_datums_give_a_loss_the_inputs_its_registration_names(registries):
    """The action mask goes in the input a loss registers as its ``action_mask``; the others get none."""
    @losses.register_loss("masked_pg", inputs=("target_tokens", "advantages"),
                          optional_inputs=("sampled_only",), action_mask="sampled_only")
    def masked_pg(logprobs, inputs, segments, config):
        return -(inputs["sampled_only"] * inputs["advantages"] * logprobs).sum(), {}

    ep = episode(1.0)
    ep.tokens, ep.logprobs, ep.action_mask = [5, 6, 7, 8], [0.0, 0.0, -0.5, -0.7], [0, 0, 1, 1]
    ep.turn_spans, ep.turn_advantages = [(2, 4)], [1.0]
    inputs = advantages.to_datum(ep, "masked_pg").loss_fn_inputs
    assert inputs["sampled_only"].data == [0.0, 1.0, 1.0]
    assert set(advantages.to_datum(ep, "ppo").loss_fn_inputs) == {
        "target_tokens", "logprobs", "advantages"}
    assert "sequence_ratio_mask" in advantages.to_datum(ep, "gspo").loss_fn_inputs
    assert advantages.needs_provenance("stable_reinforce") and not advantages.needs_provenance("masked_pg")
    with pytest.raises(TypeError, match="loss 'stray': action_mask 'mask' is none of its inputs"):
        losses.register_loss("stray", inputs=("target_tokens",), action_mask="mask")
