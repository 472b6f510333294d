"""The chat formats of Tinker's model lineup against tinker-cookbook's renderers (the reference), on
tokenizers that carry each family's special tokens (built offline): a rollout's tokens are the
reference's generation prompt at every turn, the sampled replies parse back, and every model of the
cookbook's model list gets its recommended renderer."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from polyrl.errors import UserInputError
from polyrl.models.chat_tokenizers import FAMILIES, build_chat_tokenizer
from polyrl.renderers import get_renderer, infer_renderer, renderer_names, resolve_renderer
from polyrl.renderers.cookbook import NAMES, NEEDS_TML_RENDERERS, CookbookRenderer

cookbook = pytest.importorskip("tinker_cookbook.renderers")
from tinker_cookbook import model_info  # noqa: E402
from tinker_cookbook.renderers.base import TrainOnWhat  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

POLYRL_OWN = ("qwen3", "qwen3_disable_thinking", "llama3")  # the cookbook's names polyrl renders itself
BUILDABLE = [n for n in NAMES if n not in NEEDS_TML_RENDERERS]
NO_TOOLS = {"role_colon", "llama3"}  # the cookbook has no tool-calling format for these
# Formats that never write reasoning into a turn (instruct models, thinking switched off).
NO_THINKING = {"role_colon", "llama3", "qwen3_instruct", "qwen3_vl_instruct", "deepseekv3",
               "deepseekv3_disable_thinking"}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
CALL_ID = "functions.calculator:0"  # Kimi's native id; the adapter gives id-less calls the same shape


def family(name: str) -> str:
    for prefix in ("qwen", "deepseek", "gpt_oss", "kimi", "glm", "nemotron", "llama3"):
        if name.startswith(prefix):
            return prefix
    if name == "role_colon":
        return "llama3"
    raise AssertionError(name)


@pytest.fixture(scope="module")
def tokenizers():
    return {fam: build_chat_tokenizer(fam) for fam in FAMILIES}


def thinks(name: str) -> bool:
    return name not in NO_THINKING and "disable_thinking" not in name


def reference(name: str, tokenizer):
    ref = cookbook.get_renderer(name, tokenizer)
    if hasattr(ref, "current_date"):
        ref.current_date = "2026-01-01"  # harmony's system prompt carries the date
    return ref


def ours(name: str, tokenizer):
    renderer = get_renderer(name, tokenizer)
    if isinstance(renderer, CookbookRenderer) and hasattr(renderer.ref, "current_date"):
        renderer.ref.current_date = "2026-01-01"
    return renderer


def assistant(text: str, reasoning: str | None, call: str | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if call:
        message["tool_calls"] = [{"id": CALL_ID, "type": "function",
                                  "function": {"name": "calculator", "arguments": {"expression": call}}}]
    return message


def episode(name: str):
    """(initial messages, tools, [(assistant message, environment reply)]): a tool call, its result, an
    answer, a follow-up question and a last answer; with reasoning where the format has it."""
    think = thinks(name)
    initial = [{"role": "system", "content": "You are a careful assistant."},
               {"role": "user", "content": "What is 12 * 7?"}]
    if name in NO_TOOLS:
        return initial, None, [
            (assistant("It is 84.", None), [{"role": "user", "content": "And 84 + 1?"}]),
            (assistant("It is 85.", None), [{"role": "user", "content": "Thanks."}]),
        ]
    tool_reply = {"role": "tool", "tool_call_id": CALL_ID, "name": "calculator", "content": "84"}
    return initial, [CALCULATOR], [
        (assistant("Let me compute that.", "I should use the tool." if think else None, "12 * 7"),
         [tool_reply]),
        (assistant("It is 84.", "The tool said 84." if think else None),
         [{"role": "user", "content": "And 84 + 1?"}]),
        (assistant("It is 85.", "Add one." if think else None), [{"role": "user", "content": "Thanks."}]),
    ]


def to_reference(renderer, messages, tools):
    """The conversation as the reference renderer takes it (the adapter's own conversion is what is
    under test, so it is redone here from the cookbook's documented shapes)."""
    from tinker_cookbook.renderers.base import TextPart, ThinkingPart, ToolCall

    out = []
    for m in messages:
        r = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content"):
            r["content"] = [ThinkingPart(type="thinking", thinking=m["reasoning_content"])] + (
                [TextPart(type="text", text=m["content"])] if m["content"] else [])
        if m.get("tool_calls"):
            r["tool_calls"] = [
                ToolCall(id=c["id"], function=ToolCall.FunctionBody(
                    name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"])))
                for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if key in m:
                r[key] = m[key]
        out.append(r)
    if tools:
        system = out.pop(0)["content"] if out and out[0]["role"] == "system" else ""
        out = renderer.create_conversation_prefix_with_tools([t["function"] for t in tools], system) + out
    return out


def sampled_by_reference(ref, conversation) -> list[int]:
    """What the model samples for the conversation's last (assistant) message, per the reference: its
    supervised rendering minus the generation prompt before that message."""
    prompt = ref.build_generation_prompt(conversation[:-1]).to_ints()
    full = ref.build_supervised_example(conversation, TrainOnWhat.LAST_ASSISTANT_MESSAGE)[0].to_ints()
    assert full[: len(prompt)] == prompt
    return full[len(prompt):]


def same_message(parsed: dict, expected: dict, name: str) -> None:
    assert parsed["content"].strip() == expected["content"], (name, parsed)
    assert (parsed.get("reasoning_content") or None) == expected.get("reasoning_content"), (name, parsed)
    assert parsed["tool_call_errors"] == [], (name, parsed)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in expected.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"]] == want, name
    if name not in POLYRL_OWN:  # polyrl's own renderers number calls call_0, call_1, ...
        assert [c["id"] for c in parsed["tool_calls"]] == [c["id"] for c in expected.get("tool_calls", [])]


# ---------------------------------------------------------------- the reference's names


def test_every_cookbook_renderer_name_is_a_polyrl_renderer():
    source = inspect.getsource(cookbook.get_renderer)
    cookbook_names = set(re.findall(r'name == "([^"]+)"', source))
    assert len(cookbook_names) > 40
    assert cookbook_names == set(NAMES) | set(POLYRL_OWN)
    assert cookbook_names <= set(renderer_names())
    assert {"qwen3_game", "qwen3_general", "no", "chatml"} <= set(renderer_names())


@pytest.mark.parametrize("name", sorted(NEEDS_TML_RENDERERS))
def test_renderers_built_on_tml_renderers_are_refused_clearly(tokenizers, name):
    with pytest.raises(UserInputError, match="tml-renderers") as info:
        get_renderer(name, tokenizers["kimi"])
    assert name in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- rollouts against the reference


@pytest.mark.parametrize("name", BUILDABLE + list(POLYRL_OWN))
def test_rollout_is_the_references_prompt_at_every_turn(tokenizers, name):
    """Initial prompt, then per turn: the reply as the reference renders it (what the model samples),
    the continuation of the environment's messages. The prompt equals the reference's; each
    continuation is how the reference's next prompt ends; where the reference keeps the sequence
    extension property, the whole sequence is its next prompt; every reply parses back."""
    tokenizer = tokenizers[family(name)]
    ref, renderer = reference(name, tokenizer), ours(name, tokenizer)
    initial, tools, turns = episode(name)
    messages = list(initial)
    tokens = renderer.initial_prompt(messages, tools)
    assert tokens == ref.build_generation_prompt(to_reference(ref, messages, tools)).to_ints()
    exact = ref.has_extension_property
    for reply, env in turns:
        sampled = sampled_by_reference(ref, to_reference(ref, messages + [reply], tools))
        same_message(renderer.parse_response(sampled), reply, name)
        messages += [reply, *env]
        continuation = renderer.continuation(env, assistant_finished=True)
        tokens += sampled + continuation
        expected = ref.build_generation_prompt(to_reference(ref, messages, tools)).to_ints()
        assert expected[-len(continuation):] == continuation, (name, renderer.decode(continuation))
        # ... and it starts right after the reply's end of turn (not a token early or late)
        head = renderer.decode(expected[: -len(continuation)])
        stops = renderer.stop_sequences()
        if isinstance(stops[0], int):
            assert sampled[-1] in stops, name
            end = renderer.decode(sampled[-1:])
        else:
            end = stops[0]
            assert renderer.decode(sampled).endswith(end), name
        assert head.endswith(end) or (end == "<|return|>" and head.endswith("<|end|>")), (name, head[-40:])
        if exact:
            assert tokens == expected, name
    # a turn cut by max_tokens is closed as history closes it, then continues the same way
    env = [{"role": "user", "content": "Go on."}]
    finished = renderer.continuation(env, assistant_finished=True)
    cut = renderer.continuation(env, assistant_finished=False)
    assert len(cut) > len(finished) and cut[-len(finished):] == finished


@pytest.mark.parametrize("name", BUILDABLE)
def test_supervised_is_the_rollout_with_weight_on_the_replies(tokenizers, name):
    tokenizer = tokenizers[family(name)]
    ref, renderer = reference(name, tokenizer), ours(name, tokenizer)
    initial, tools, turns = episode(name)
    messages, tokens, weights = list(initial), renderer.initial_prompt(initial, tools), []
    weights = [0.0] * len(tokens)
    for k, (reply, env) in enumerate(turns):
        sampled = sampled_by_reference(ref, to_reference(ref, messages + [reply], tools))
        tokens += sampled
        weights += [1.0] * len(sampled)
        messages.append(reply)
        if k + 1 < len(turns):
            continuation = renderer.continuation(env)
            tokens += continuation
            weights += [0.0] * len(continuation)
            messages += env
    assert renderer.supervised(messages, tools) == (tokens, weights)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("name", [n for n in BUILDABLE if thinks(n)])
def test_a_reply_cut_while_thinking_is_all_reasoning(tokenizers, name):
    tokenizer = tokenizers[family(name)]
    ref, renderer = reference(name, tokenizer), ours(name, tokenizer)
    initial, tools, turns = episode(name)
    reply = assistant("The answer is 84.", "Twelve sevens are eighty-four, so \\boxed{84}.")
    sampled = sampled_by_reference(ref, to_reference(ref, initial + [reply], tools))
    text = renderer.decode(sampled)
    cut = renderer.encode(text[: text.index("so \\boxed")])
    message = renderer.parse_response(cut)
    assert message["content"] == "" and "Twelve sevens" in message["reasoning_content"], message
    assert message["tool_calls"] == [] and message["tool_call_errors"] == []


BREAK_THE_CALL = {  # per format, an edit that makes a well-formed tool call malformed
    "qwen3_5": ("</function>", ""),
    "nemotron3": ("</function>", ""),
    "glm5_3_max_reasoning": ("</arg_key>", ""),
    "deepseekv4_1": ('string="true"', 'string="maybe"'),
    "deepseekv3": ('"1 + 1"', '"1 + 1"}{'),
    "kimi_k25": ('"1 + 1"', '"1 + 1"}{'),
    "gpt_oss_medium_reasoning": ('"1 + 1"', '"1 + 1"}{'),
}


@pytest.mark.parametrize("name", sorted(BREAK_THE_CALL))
def test_malformed_tool_calls_become_errors_never_exceptions(tokenizers, name):
    tokenizer = tokenizers[family(name)]
    ref, renderer = reference(name, tokenizer), ours(name, tokenizer)
    initial, tools, _ = episode(name)
    reply = assistant("Checking.", "Use the tool." if thinks(name) else None, "1 + 1")
    good = sampled_by_reference(ref, to_reference(ref, initial + [reply], tools))
    text = renderer.decode(good)
    old, new = BREAK_THE_CALL[name]
    assert old in text
    message = renderer.parse_response(renderer.encode(text.replace(old, new, 1)))
    assert message["tool_calls"] == [] and len(message["tool_call_errors"]) == 1, (name, message)
    for garbage in ([], renderer.encode("<tool_call><tool_call></think>"), renderer.stop_sequences()[:1] * 3):
        assert renderer.parse_response(garbage)["role"] == "assistant"


def test_harmony_tool_results_get_their_function_name_from_the_call_id(tokenizers):
    """gpt-oss writes a tool result under its function's name; polyrl's environments reply with the
    call's id only, which for this adapter names the function."""
    renderer = ours("gpt_oss_medium_reasoning", tokenizers["gpt_oss"])
    reply = renderer.encode('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
                            '{"expression": "1 + 1"}<|call|>')
    call = renderer.parse_response(reply)["tool_calls"][0]
    assert call["id"] == "functions.calculator:0" and call["function"]["arguments"] == {"expression": "1 + 1"}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "2"}
    text = renderer.decode(renderer.continuation([result]))
    assert text.startswith("<|start|>functions.calculator to=assistant<|channel|>commentary"
                           "<|message|>2<|end|>")


def test_role_colon_turns_end_at_the_next_user_header(tokenizers):
    renderer = ours("role_colon", tokenizers["llama3"])
    assert renderer.stop_sequences() == ["\n\nUser:"]
    more = renderer.continuation([{"role": "user", "content": "More."}])
    assert renderer.decode(more) == " More.\n\nAssistant:"
    with pytest.raises(ValueError, match="user message"):
        renderer.continuation([{"role": "system", "content": "New rules."}])


# ---------------------------------------------------------------- which format a model gets


def lineup():
    tables = [getattr(model_info, f) for f in dir(model_info) if re.fullmatch(r"get_\w+_info", f)]
    return [(f"{a.organization}/{v}", a.recommended_renderers[0]) for t in tables for v, a in t().items()]


def test_every_model_of_the_lineup_gets_its_recommended_renderer(tokenizers):
    models = lineup()
    assert len(models) >= 40 and ("Qwen/Qwen3.5-4B", "qwen3_5") in models
    for model, recommended in models:
        for tokenizer in (tokenizers["qwen"], tokenizers["llama3"]):  # the name decides, not the tokens
            assert infer_renderer(model, tokenizer) == recommended, model
        assert infer_renderer(model.lower() + ":step-100", tokenizers["qwen"]) == recommended


def qwen_tokenizer_with(template: str):
    tokenizer = build_chat_tokenizer("qwen")
    tokenizer.chat_template = template
    return tokenizer


# The parts of Qwen3's and Qwen3.5's chat templates that tell them apart: JSON or XML tool calls.
QWEN3_TEMPLATE = '{# <think> #}<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
QWEN3_5_TEMPLATE = "{# <think> #}<tool_call>\n<function=example_function_name>\n<parameter=example"


def test_qwen3_5_is_never_given_qwen3s_format(tmp_path):
    """Before: any name with "qwen" and ChatML tokens got ``qwen3`` -- a Qwen3.5 model trained in Qwen3's
    format without a word."""
    tokenizer = qwen_tokenizer_with(QWEN3_5_TEMPLATE)
    assert infer_renderer("Qwen/Qwen3.5-4B", tokenizer) == "qwen3_5"
    assert infer_renderer("Qwen/Qwen3.6-27B", tokenizer) == "qwen3_5"
    assert infer_renderer("Qwen/Qwen3.8-27B", tokenizer) == "qwen3_8_xhigh_reasoning"
    # a local copy says which model it is by its recorded name, its hub-cache path or its directory name
    recorded = tmp_path / "checkpoint"
    recorded.mkdir()
    (recorded / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3.5-9B"}))
    cached = tmp_path / "hub" / "models--Qwen--Qwen3.5-27B" / "snapshots" / "0123abcd"
    cached.mkdir(parents=True)
    named = tmp_path / "qwen3.5-35b-a3b"
    named.mkdir()
    for directory in (recorded, cached, named):
        assert infer_renderer(str(directory), tokenizer) == "qwen3_5", directory
    # not in the model list: a Qwen3.5-style template or a later Qwen's name is an error, not a guess
    anonymous = tmp_path / "my-model"
    anonymous.mkdir()
    for model, tok in ((str(anonymous), tokenizer), ("Qwen/Qwen3.5-2B", qwen_tokenizer_with(QWEN3_TEMPLATE)),
                       ("Qwen/Qwen3.5-2B", build_chat_tokenizer("qwen"))):
        with pytest.raises(UserInputError, match="Qwen3.5") as info:
            infer_renderer(model, tok)
        assert "\n" not in str(info.value) and "qwen3_5" in str(info.value)


def test_local_and_tiny_models_fall_back_to_the_tokenizer(tmp_path, tokenizers):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    assert infer_renderer(str(tiny), qwen_tokenizer_with(QWEN3_TEMPLATE)) == "qwen3"
    assert infer_renderer("Qwen/Qwen3-0.6B", qwen_tokenizer_with(QWEN3_TEMPLATE)) == "qwen3"  # not listed
    assert infer_renderer(str(tiny), qwen_tokenizer_with("{{ messages }}")) == "chatml"
    assert infer_renderer("meta-llama/Llama-3.2-1B-Instruct", tokenizers["llama3"]) == "llama3"


@pytest.mark.parametrize("fam", ["deepseek", "gpt_oss", "kimi", "glm"])
def test_an_unknown_model_is_a_one_line_error_naming_it_and_the_choices(tokenizers, fam):
    for model in ("org/mystery-model", "deepseek-ai/DeepSeek-V9", "openai/gpt-oss-7b"):
        with pytest.raises(UserInputError) as info:
            infer_renderer(model, tokenizers[fam])
        message = str(info.value)
        assert "\n" not in message and model in message
        assert all(n in message for n in ("qwen3_5", "gpt_oss_medium_reasoning", "kimi_k25", "role_colon"))
        with pytest.raises(UserInputError, match=re.escape(model)):
            resolve_renderer(None, model, tokenizers[fam])


def test_resolve_renderer_builds_the_configured_or_inferred_one(tokenizers):
    assert resolve_renderer(None, "openai/gpt-oss-20b", tokenizers["gpt_oss"]).name == "gpt_oss_no_sysprompt"
    configured = resolve_renderer("glm5_3_low_reasoning", "whatever", tokenizers["glm"])
    assert configured.name == "glm5_3_low_reasoning"
    with pytest.raises(UserInputError, match="unknown renderer 'glm5'"):
        resolve_renderer("glm5", "zai-org/GLM-5.3", tokenizers["glm"])
    # the configured format with a tokenizer that lacks its tokens: one line naming the renderer
    for name in BUILDABLE:
        if name == "role_colon":
            continue
        other = tokenizers["glm" if family(name) != "glm" else "qwen"]
        expected = f"renderer '{name}' needs the model's special tokens"
        with pytest.raises(UserInputError, match=expected) as info:
            resolve_renderer(name, "Qwen/Qwen3-8B", other)
        assert "\n" not in str(info.value)


def test_without_tinker_cookbook_a_lineup_format_says_how_to_install_it(tokenizers, monkeypatch):
    import sys

    for module in [m for m in sys.modules if m == "tinker_cookbook" or m.startswith("tinker_cookbook.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "tinker_cookbook", None)
    with pytest.raises(UserInputError, match=re.escape("pip install --no-deps tinker-cookbook==0.6.1")):
        get_renderer("qwen3_5", tokenizers["qwen"])
    assert get_renderer("qwen3", tokenizers["qwen"]).name == "qwen3"  # polyrl's own need nothing


def test_the_registry_has_no_import_cycle():
    """base.py defines the registry and imports no renderer module (only the leaves ``polyrl.errors`` and
    ``polyrl.images``, which import no renderer); the package imports them all."""
    import polyrl.renderers.base as base

    tree = ast.parse(Path(base.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                 if n.module == "polyrl"]
    assert not [m for m in imported if m.startswith("polyrl") and m not in LEAVES], imported
    for leaf in LEAVES:
        leaf_tree = ast.parse(Path(importlib.import_module(leaf).__file__).read_text())
        assert not [n for n in ast.walk(leaf_tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    and "polyrl" in ast.unparse(n)], leaf


LEAVES = ("polyrl.errors", "polyrl.images")


def test_importing_polyrl_renderers_does_not_import_the_cookbook():
    import subprocess
    import sys

    code = "import sys, polyrl.renderers as r; r.renderer_names(); print('tinker_cookbook' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



def test_the_command_line_prints_one_line_and_exits_2(tiny_model_dir, tmp_path):
    """``polyrl chat`` on a model whose format polyrl does not know, and with a format its tokenizer
    cannot carry: one ``error:`` line each, exit 2, no traceback."""
    import shutil
    import subprocess
    import sys

    mystery = tmp_path / "mystery-model"
    shutil.copytree(tiny_model_dir, mystery)
    for file in mystery.glob("tokenizer*"):
        file.unlink()
    build_chat_tokenizer("gpt_oss", vocab_size=512).save_pretrained(mystery)
    cases = [([str(mystery)], "cannot infer the chat format of model"),
             ([tiny_model_dir, "--renderer", "kimi_k25"], "renderer 'kimi_k25' needs the model's special")]
    for args, expected in cases:
        out = subprocess.run([sys.executable, "-m", "polyrl.cli", "chat", *args, "--device", "cpu"],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
        assert expected in lines[0], lines[0]


def test_polyrl_qwen3_follows_qwen3s_template_where_the_cookbook_departs_from_it(tokenizers):
    """Deliberate: parallel tool results share one user turn in Qwen3's chat template (and in polyrl's
    ``qwen3``); the cookbook's ``qwen3`` gives each its own turn. One result: the same tokens."""
    tokenizer = tokenizers["qwen"]
    ref, renderer = reference("qwen3", tokenizer), get_renderer("qwen3", tokenizer)
    one = [{"role": "tool", "tool_call_id": "call_0", "content": "4"}]
    two = one + [{"role": "tool", "tool_call_id": "call_1", "content": "9"}]
    conversation = [{"role": "user", "content": "Compute."}, assistant("", None, "2 + 2")]
    for results, same in ((one, True), (two, False)):
        expected = ref.build_generation_prompt(to_reference(ref, conversation + results, None)).to_ints()
        continuation = renderer.continuation(results)
        assert (expected[-len(continuation):] == continuation) is same
        assert renderer.decode(continuation).count("<|im_start|>user") == 1
