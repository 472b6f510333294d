"""Renderers: prompts match the chat template token for token, rollouts never rewrite history,
model replies parse into messages (and malformed tool calls into errors, never exceptions)."""

from __future__ import annotations

import json

import pytest

from polyrl.renderers import get_renderer, infer_renderer, renderer_names

LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful assistant."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def tool(text: str, call_id: str = "call_0") -> dict:
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def call_text(expression: str) -> str:
    """A Qwen3 tool call exactly as the model is taught to write it."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def template_ids(tokenizer, messages, tools=None, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )


def rollout(renderer, initial, tools, turns, end="<|im_end|>"):
    """Simulate sampling: the model 'emits' each assistant text (+ end token); the environment
    answers with the given messages. Returns the token sequence and the message-level conversation
    (assistant turns as parsed from the sampled tokens)."""
    tokens = renderer.initial_prompt(initial, tools)
    conversation = list(initial)
    for assistant_text, env_messages in turns:
        sampled = renderer.encode(assistant_text + end)
        tokens += sampled
        tokens += renderer.continuation(env_messages, assistant_finished=True)
        conversation += [renderer.parse_response(sampled), *env_messages]
    return tokens, conversation


def weighted_runs(renderer, tokens, weights) -> list[str]:
    """Decoded text of each maximal run of weight-1 tokens."""
    assert set(weights) <= {0.0, 1.0} and len(weights) == len(tokens)
    runs, current = [], []
    for t, w in zip(tokens, weights):
        if w:
            current.append(t)
        elif current:
            runs.append(renderer.decode(current))
            current = []
    if current:
        runs.append(renderer.decode(current))
    return runs


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    return get_renderer("qwen3", tokenizer)


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_model_dir):
    """The tiny tokenizer plus Llama 3's special tokens as single tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA_TOKENS})
    return tok


def bare_tokenizer():
    """A tokenizer with no chat tokens at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")


# ---------------------------------------------------------------- qwen3: prompts and prefixes


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
def test_qwen3_initial_prompt_matches_chat_template(tokenizer, qwen3, tools, with_system):
    messages = ([SYSTEM] if with_system else []) + [user("What is 12 * 7?")]
    ours = qwen3.initial_prompt(messages, tools)
    assert ours == template_ids(tokenizer, messages, tools)
    assert ours[-3:] == qwen3.encode("<|im_start|>assistant\n")[-3:]
    assert ("<tools>" in qwen3.decode(ours)) == bool(tools)


def test_qwen3_initial_prompt_with_history_matches_chat_template(tokenizer, qwen3):
    """A prompt that already holds assistant turns (few-shot, tool history) renders like the template,
    including its rule of dropping thinking before the last user query."""
    messages = [
        SYSTEM,
        user("What is 2 + 3?"),
        {"role": "assistant", "content": "", "reasoning_content": "dropped", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]},
        tool("5"),
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\nIt is 5."},
        user("And 4 + 4?"),
    ]
    ours = qwen3.initial_prompt(messages, TOOLS)
    assert ours == template_ids(tokenizer, messages, TOOLS)
    assert "dropped" not in qwen3.decode(ours) and "It is 5." in qwen3.decode(ours)


def test_qwen3_disable_thinking_prompt(tokenizer):
    renderer = get_renderer("qwen3_disable_thinking", tokenizer)
    messages = [SYSTEM, user("Hi")]
    ours = renderer.initial_prompt(messages, TOOLS)
    assert ours == template_ids(tokenizer, messages, TOOLS, enable_thinking=False)
    assert renderer.decode(ours).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert renderer.decode(renderer.continuation([user("More")])).endswith("<think>\n\n</think>\n\n")


def test_qwen3_multi_turn_rollout_is_the_template_rendering(tokenizer, qwen3):
    tokens, conversation = rollout(
        qwen3,
        [SYSTEM, user("Guess my number between 1 and 10.")],
        None,
        [("Is it 5?", [user("Higher.")]), ("Is it 8?", [user("Lower.")])],
    )
    assert tokens == template_ids(tokenizer, conversation)
    assert [m["content"] for m in conversation if m["role"] == "assistant"] == ["Is it 5?", "Is it 8?"]


def test_qwen3_tool_rollout_is_the_template_rendering(tokenizer, qwen3):
    tokens, conversation = rollout(
        qwen3,
        [SYSTEM, user("Compute 3 * 4, then 5 + 6 and 7 - 1.")],
        TOOLS,
        [
            (call_text("3 * 4"), [tool("12")]),
            (
                f"Two more.\n{call_text('5 + 6')}\n{call_text('7 - 1')}",
                [tool("11", "call_0"), tool("6", "call_1")],
            ),
        ],
    )
    assert tokens == template_ids(tokenizer, conversation, TOOLS)
    second = conversation[4]
    assert second["content"] == "Two more." and second["tool_call_errors"] == []
    assert [c["function"]["arguments"]["expression"] for c in second["tool_calls"]] == ["5 + 6", "7 - 1"]
    # Both tool results share one user turn.
    assert qwen3.decode(tokens).count("<|im_start|>user") == 3


def test_qwen3_keeps_sampled_thinking_where_the_template_would_drop_it(tokenizer, qwen3):
    """The point of never re-rendering: Qwen3's template strips earlier turns' thinking, so re-rendering
    would train on a sequence the model never produced. Our tokens keep what was sampled."""
    think = "<think>\nTwo plus two is four.\n</think>\n\n"
    tokens, conversation = rollout(qwen3, [user("2 + 2?")], None, [(think + "4.", [user("Thanks!")])])
    assert conversation[1]["reasoning_content"] == "Two plus two is four."
    rerendered = template_ids(tokenizer, conversation)
    assert tokens != rerendered
    assert think in qwen3.decode(tokens)
    assert qwen3.decode(rerendered) == qwen3.decode(tokens).replace(think, "")


def test_qwen3_truncated_turn_is_closed(tokenizer, qwen3):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert qwen3.stop_sequences() == [im_end]
    finished = qwen3.continuation([user("Go on.")], assistant_finished=True)
    truncated = qwen3.continuation([user("Go on.")], assistant_finished=False)
    assert qwen3.decode(finished) == "\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert truncated == [im_end] + finished
    # The closed truncated turn is a well-formed conversation.
    messages = [user("Count to ten.")]
    tokens = qwen3.initial_prompt(messages) + qwen3.encode("1 2 3") + truncated
    closed = messages + [{"role": "assistant", "content": "1 2 3"}, user("Go on.")]
    assert tokens == template_ids(tokenizer, closed)


# ---------------------------------------------------------------- qwen3: supervised


def test_qwen3_supervised_weights_cover_exactly_assistant_tokens(tokenizer, qwen3):
    messages = [
        SYSTEM,
        user("What is 6 * 7?"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]},
        tool("42"),
        {"role": "assistant", "content": "It is 42."},
    ]
    tokens, weights = qwen3.supervised(messages, TOOLS)
    assert weighted_runs(qwen3, tokens, weights) == [call_text("6 * 7") + "<|im_end|>", "It is 42.<|im_end|>"]
    # Same tokens a rollout produces, i.e. the template's rendering of the conversation so far.
    follow_up = template_ids(tokenizer, messages + [user("next")], TOOLS)
    assert tokens == follow_up[: len(tokens)]
    assert tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and weights[-1] == 1.0
    prompt = qwen3.initial_prompt(messages[:2], TOOLS)
    assert tokens[: len(prompt)] == prompt and not any(weights[: len(prompt)])


def test_qwen3_supervised_writes_reasoning(qwen3):
    messages = [user("2 + 2?"), {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    tokens, weights = qwen3.supervised(messages)
    assert weighted_runs(qwen3, tokens, weights) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]


# ---------------------------------------------------------------- qwen3: parsing


def parse(renderer, text: str) -> dict:
    return renderer.parse_response(renderer.encode(text))


def test_qwen3_parse_text_and_thinking_round_trip(qwen3):
    for text, content, reasoning in [
        ("The answer is 4.<|im_end|>", "The answer is 4.", None),
        ("<think>\nLet me add.\n</think>\n\nThe answer is 4.<|im_end|>", "The answer is 4.", "Let me add."),
    ]:
        tokens = qwen3.encode(text)
        message = qwen3.parse_response(tokens)
        assert message["content"] == content and message.get("reasoning_content") == reasoning
        assert message["tool_calls"] == [] and message["tool_call_errors"] == []
        assert qwen3.assistant_tokens(message) == tokens
    # Opening tag pre-filled by the prompt; and a reply cut off mid-thought.
    assert parse(qwen3, "mulling</think>\n\nDone.")["reasoning_content"] == "mulling"
    cut = parse(qwen3, "<think>\nstill thinking")
    assert cut["reasoning_content"] == "still thinking" and cut["content"] == ""


def test_qwen3_parse_tool_calls_round_trip(qwen3):
    one = qwen3.encode(call_text("1 + 1") + "<|im_end|>")
    message = qwen3.parse_response(one)
    assert message["content"] == "" and message["tool_call_errors"] == []
    function = {"name": "calculator", "arguments": {"expression": "1 + 1"}}
    assert message["tool_calls"] == [{"id": "call_0", "type": "function", "function": function}]
    assert qwen3.assistant_tokens(message) == one
    two = qwen3.encode(f"Both:\n{call_text('1')}\n{call_text('2')}<|im_end|>")
    message = qwen3.parse_response(two)
    assert message["content"] == "Both:"
    assert [c["id"] for c in message["tool_calls"]] == ["call_0", "call_1"]
    assert qwen3.assistant_tokens(message) == two


def test_qwen3_tool_call_inside_thinking_is_not_a_call(qwen3):
    message = parse(qwen3, f"<think>\nmaybe {call_text('1')}\n</think>\n\nNo tools needed.")
    assert message["tool_calls"] == [] and message["content"] == "No tools needed."


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>', "invalid JSON"),
        ('<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "calculator", "arguments": "1 + 1"}\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n["calculator"]\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed"),
    ],
)
def test_qwen3_malformed_tool_calls_become_errors(qwen3, bad, problem):
    message = parse(qwen3, f"Checking.\n{call_text('2 * 2')}\n{bad}<|im_end|>")
    assert len(message["tool_call_errors"]) == 1 and problem in message["tool_call_errors"][0]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [{"expression": "2 * 2"}]
    assert message["content"] == "Checking."


def test_chatml_keeps_think_tags_as_text(tokenizer):
    renderer = get_renderer("chatml", tokenizer)
    message = parse(renderer, "<think>\nhmm\n</think>\n\nHi<|im_end|>")
    assert message["content"] == "<think>\nhmm\n</think>\n\nHi" and "reasoning_content" not in message
    messages = [SYSTEM, user("Hi")]
    assert renderer.initial_prompt(messages, TOOLS) == template_ids(tokenizer, messages, TOOLS)


# ---------------------------------------------------------------- llama3


def llama_text(*turns: tuple[str, str]) -> str:
    return "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}" + ("<|eot_id|>" if role != "gen" else "")
        for role, text in turns
    ).replace("<|start_header_id|>gen<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>")


def test_llama3_with_llama_special_tokens(llama_tokenizer):
    renderer = get_renderer("llama3", llama_tokenizer)
    eot = llama_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert renderer.stop_sequences() == [eot]
    call = json.dumps({"name": "calculator", "parameters": {"expression": "2 + 2"}})
    turns = [(call, [tool("4")]), ("It is 4.", [user("Thanks")])]
    tokens, conversation = rollout(renderer, [SYSTEM, user("2 + 2?")], None, turns, "<|eot_id|>")
    expected = llama_text(
        ("system", SYSTEM["content"]), ("user", "2 + 2?"), ("assistant", call), ("ipython", "4"),
        ("assistant", "It is 4."), ("user", "Thanks"), ("gen", ""),
    )
    assert tokens == llama_tokenizer.encode(expected, add_special_tokens=False)
    function = {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    assert conversation[2]["tool_calls"][0]["function"] == function
    assert conversation[4]["content"] == "It is 4."
    assert renderer.continuation([user("x")], assistant_finished=False)[0] == eot


def test_llama3_with_a_tokenizer_lacking_its_tokens(tokenizer):
    """The tiny ChatML tokenizer has no Llama tokens: markers become text and the stop is a string."""
    renderer = get_renderer("llama3", tokenizer)
    assert renderer.stop_sequences() == ["<|eot_id|>"]
    tokens, conversation = rollout(renderer, [user("Hi")], TOOLS, [("Hello!", [user("Bye")])], "<|eot_id|>")
    text = renderer.decode(tokens)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou have access")
    assert json.dumps(TOOLS[0], indent=4) in text
    assert text.endswith(
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert conversation[1]["content"] == "Hello!"


def test_llama3_parse_and_supervised(tokenizer):
    renderer = get_renderer("llama3", tokenizer)
    calls = 'Let me check.\n{"name": "a", "parameters": {"x": 1}}\n{"name": "b", "parameters": {}}<|eot_id|>'
    message = parse(renderer, calls)
    assert message["content"] == "Let me check." and message["tool_call_errors"] == []
    assert [(c["id"], c["function"]["name"]) for c in message["tool_calls"]] == [
        ("call_0", "a"),
        ("call_1", "b"),
    ]
    assert renderer.assistant_tokens(message) == renderer.encode(calls)
    assert "invalid JSON" in parse(renderer, '{"name": "a", "parameters": {"x": ')["tool_call_errors"][0]
    assert '"name"' in parse(renderer, '{"name": 3, "parameters": {}}')["tool_call_errors"][0]
    trailing = parse(renderer, 'Hm.\n{"name": "a", "parameters": {}}\nDone.<|eot_id|>')
    assert trailing["content"] == "Hm.\nDone." and len(trailing["tool_calls"]) == 1
    assert parse(renderer, "Just text.<|eot_id|>") == {
        "role": "assistant", "content": "Just text.", "tool_calls": [], "tool_call_errors": []}
    tokens, weights = renderer.supervised([user("Hi"), {"role": "assistant", "content": "Hello!"}])
    assert weighted_runs(renderer, tokens, weights) == ["Hello!<|eot_id|>"]


# ---------------------------------------------------------------- plain (GEM) templates

# GEM's reference-trainer templates, verbatim ({} is the observation).
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."
GAME = (
    "<|im_start|>user\nYou are playing language games. Make valid actions to win.\nObservation: {}"
    + BOXED
    + "<|im_end|>\n<|im_start|>assistant\n"
)
GENERAL = "<|im_start|>user\nQuestion: {}" + BOXED + "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name, template", [("qwen3_game", GAME), ("qwen3_general", GENERAL)])
def test_gem_qwen3_templates(tokenizer, name, template):
    renderer = get_renderer(name, tokenizer)
    assert renderer.stop_sequences() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    tokens, conversation = rollout(renderer, [user("Guess 1-10.")], None, [("\\boxed{5}", [user("Higher.")])])
    expected = template.format("Guess 1-10.") + "\\boxed{5}<|im_end|>\n" + template.format("Higher.")
    assert renderer.decode(tokens) == expected
    assert conversation[1] == {
        "role": "assistant", "content": "\\boxed{5}", "tool_calls": [], "tool_call_errors": []}
    closing = renderer.continuation([user("x")], assistant_finished=False)
    assert renderer.decode(closing).startswith("<|im_end|>\n")
    tokens, weights = renderer.supervised(conversation[:2])
    assert weighted_runs(renderer, tokens, weights) == ["\\boxed{5}<|im_end|>"]
    with pytest.raises(ValueError, match="tools"):
        renderer.initial_prompt([user("x")], TOOLS)


def test_gem_no_template(tokenizer):
    renderer = get_renderer("no", tokenizer)
    assert renderer.stop_sequences() == [tokenizer.eos_token_id]
    turns = [("act", [user(" Obs 2.")])]
    tokens, conversation = rollout(renderer, [user("Obs 1. ")], None, turns, tokenizer.eos_token)
    assert renderer.decode(tokens) == f"Obs 1. act{tokenizer.eos_token} Obs 2."
    assert conversation[1]["content"] == "act"


# ---------------------------------------------------------------- registry and inference


def test_registry_and_infer_renderer(tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    plain_tokenizer = bare_tokenizer()

    expected = {"qwen3", "qwen3_disable_thinking", "chatml", "llama3", "qwen3_game", "qwen3_general", "no"}
    assert expected <= set(renderer_names())
    assert infer_renderer(tiny_model_dir, tokenizer) == "qwen3"
    bare_chatml = AutoTokenizer.from_pretrained(tiny_model_dir)
    bare_chatml.chat_template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    assert infer_renderer("org/some-chat-model", bare_chatml) == "chatml"
    assert infer_renderer("meta-llama/Llama-3.1-8B-Instruct", plain_tokenizer) == "llama3"
    with_llama_tokens = bare_tokenizer()
    with_llama_tokens.add_special_tokens({"additional_special_tokens": LLAMA_TOKENS})
    assert infer_renderer("org/unnamed", with_llama_tokens) == "llama3"
    with pytest.raises(ValueError, match="renderer") as info:
        infer_renderer("org/mystery-model", plain_tokenizer)
    assert "mystery-model" in str(info.value) and "qwen3" in str(info.value)
    with pytest.raises(KeyError):
        get_renderer("nope", tokenizer)


# SmolLM2-Instruct's chat template, verbatim: a default system prompt when the conversation has none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_writes_the_templates_default_system_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = SMOLLM2_TEMPLATE
    renderer = get_renderer(infer_renderer("HuggingFaceTB/SmolLM2-135M-Instruct", tok), tok)
    assert renderer.name == "chatml"
    assert renderer.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    for messages in ([user("What is 2 + 3?")], [SYSTEM, user("Hi")],
                     [user("a"), {"role": "assistant", "content": "b"}, user("c")]):
        assert renderer.initial_prompt(messages) == template_ids(tok, messages), messages
    # a template without one (Qwen3's) gets none
    assert get_renderer("chatml", AutoTokenizer.from_pretrained(tiny_model_dir)).default_system is None


def test_a_renderer_looks_up_its_stop_markers_once(tokenizer):
    """Every sampled turn asks for the stop sequences; the tokenizer is asked once per marker."""
    renderer = get_renderer("qwen3", tokenizer)
    calls = []
    real = tokenizer.encode

    def encode(text, *args, **kwargs):
        calls.append(text)
        return real(text, *args, **kwargs)

    tokenizer.encode = encode
    try:
        first = [renderer.stop_sequences() for _ in range(5)]
    finally:
        del tokenizer.encode
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert first == [[im_end]] * 5 and calls == ["<|im_end|>"]
