"""The schema of one ``environments`` entry of a run config: an environment type, its task splits and
its sampling and reward settings (used by ``polyrl train``, ``sft``, ``eval`` and ``play``).

A leaf like :mod:`polyrl.config.schema`, which re-exports these names.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Episodes one step may run (batch_size x num_rollouts): 1024 groups of 64, or 4096 of 16, is beyond
# the largest published RL batches; far larger sizes are typos (1e9) that would exhaust memory
# before the first line of output.
MAX_EPISODES_PER_STEP = 65_536
SplitName = Literal["train", "test"]
_SPLIT_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"shuffle": True, "num_samples": None},
    "test": {"shuffle": False, "num_samples": 32},
}


class SplitConfig(BaseModel):
    """How tasks of one split (``train`` or ``test``) of an environment are drawn."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    shuffle: bool = Field(
        True, description="Visit tasks in a seeded random order (default: true for train, false for test)."
    )
    num_samples: int | None = Field(
        None,
        gt=0,
        description="Use only the first N tasks of the split; null = all of them "
        "(default: null for train, 32 for test).",
    )
    seed: int | None = Field(None, description="Seed of this split's task order; null = use the run's seed.")


class ChatModelConfig(BaseModel):
    """A chat model the run talks to besides the policy: a model on the run's own service or one behind
    an OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(
        None, description="null = the policy's base model on the run's own service, frozen (the weights the "
        "policy trains a LoRA on are shared, not copied); a base model (a local directory or hub id) or a "
        "'tinker://' sampler checkpoint on the same service; with base_url, the model name that endpoint "
        "serves.")
    base_url: str | None = Field(
        None, description="An OpenAI-compatible endpoint ('http(s)://host/v1') to call instead of the run's "
        "service; its chat completions answer.")
    api_key_env: str = Field(
        "OPENAI_API_KEY", description="Environment variable holding base_url's API key (read when the run "
        "starts, never written anywhere); unset: no key is sent.")
    max_tokens: int = Field(256, ge=1, description="Tokens the model may write per answer.")
    temperature: float = Field(0.0, ge=0, description="Its sampling temperature (0: greedy).")
    timeout: float = Field(120, gt=0, description="Seconds a call may take; one that takes longer fails "
                                                  "its episode (counted).")

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value

    @model_validator(mode="after")
    def _named(self):
        if self.base_url is not None and not self.model:
            raise ValueError("base_url needs model: the name of the model that endpoint serves")
        return self


class PartnerConfig(ChatModelConfig):
    """The model on the other side of a multi-turn environment (a game's other seats with ``opponent:
    partner``): not trained, it answers from its own view of the conversation."""

    temperature: float = Field(1.0, ge=0, description="Its sampling temperature.")
    max_tokens: int = Field(64, ge=1, description="Tokens the partner may write per turn.")
    pool: int = Field(
        0, ge=0, description="0: the partner is model, fixed. N >= 1: a pool of past selves, the last N of "
        "model (the first member, frozen) and the run's own saved checkpoints (one joins at every "
        "save_every); each game draws its partner from the pool by the game's seed, and the episode's "
        "partner_step metric says which (the policy steps the member had trained).")

    @model_validator(mode="after")
    def _pool_on_the_service(self):
        if self.pool and self.base_url is not None:
            raise ValueError("pool: past selves are the run's own checkpoints on its service; a partner at "
                             "base_url cannot be one (drop base_url, or set pool: 0)")
        return self


class JudgeConfig(ChatModelConfig):
    """An LLM judge that grades every episode of an environment against rubrics; its score, in [0, 1],
    is added to the episode's reward (docs/guides/judges.md)."""

    rubrics: list[str] = Field(
        default_factory=list, description="Rubric items for tasks that bring none of their own (a task's "
        "own: a dataset row's 'rubrics'). Each item is judged in a call of its own; the score is their "
        "mean.")
    mode: Literal["score", "yes_no", "pairwise", "reward_model"] = Field(
        "score", description="'score': each reply graded on its own, the verdict's <score> read; 'yes_no': "
        "each reply graded on its own by reading, not writing, the judge's answer to 'does it meet the "
        "rubric?' (P(Yes) / (P(Yes) + P(No)); a model on the run's service); 'pairwise': the group's replies "
        "compared two by two (both orders), each scoring its win rate, a tie counting half; 'reward_model': "
        "model is a reward model polyrl reward-model trained (its sampler checkpoint), scoring each reply "
        "with the logprob it gives 'Yes' after template (its question; null: the default one), a "
        "Bradley-Terry score (<= 0; differences are what it learned).")
    weight: float = Field(1.0, description="reward = the environment's reward + weight * the judge's score.")
    scale: tuple[float, float] = Field(
        (0.0, 1.0), description="The range the judge gives its score in, mapped onto [0, 1]; a score "
        "outside it is an unreadable verdict.")
    template: str | None = Field(
        None, description="The judge's prompt, with the fields {context}, {answer}, {rubric}, {low} and "
        "{high} (pairwise: {context}, {answer_a}, {answer_b}, {rubric}); null = polyrl's, which asks for the "
        "score in <score>...</score> (pairwise: <preferred>A|B|tie</preferred>; docs/guides/judges.md).")
    max_concurrency: int = Field(32, ge=1, description="Judge calls in flight at once, for this "
                                                       "environment.")

    @model_validator(mode="after")
    def _consistent(self):
        if self.mode == "reward_model" and (self.base_url is not None or not self.model):
            raise ValueError("mode reward_model needs model: the reward model's sampler checkpoint on the "
                             "run's service (polyrl reward-model writes its path to reward_model.json)")
        low, high = self.scale
        if not low < high:
            raise ValueError(f"scale must be [low, high] with low < high, got {list(self.scale)}")
        if self.mode == "yes_no" and self.base_url is not None:
            raise ValueError("mode yes_no reads the judge's logprobs: its model must be on the run's "
                             "service, not an endpoint")
        if self.template is not None and self.mode not in ("reward_model", "yes_no"):
            needed = (("{answer}", "{rubric}") if self.mode == "score"
                      else ("{answer_a}", "{answer_b}", "{rubric}"))
            for field in needed:
                if field not in self.template:
                    raise ValueError(f"template must contain {field}")
        return self


def _default_splits() -> dict[SplitName, SplitConfig]:
    return {name: SplitConfig(**values) for name, values in _SPLIT_DEFAULTS.items()}  # type: ignore[misc]


class EnvConfig(BaseModel):
    """One entry of ``environments``: an environment type with its sampling and reward settings."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    type: str | None = Field(
        None,
        description="Environment type (a registered name, or 'prefix:rest' for adapters); defaults to the "
        "entry's name, so a second instance of a type needs another name and an explicit type.",
    )
    splits: dict[SplitName, SplitConfig] = Field(
        default_factory=_default_splits,
        description="Task splits, train and test by default. A split given here is merged over that split's "
        "defaults; a split set to null is left out (e.g. test: null for no held-out evaluation).",
    )
    num_rollouts: int = Field(8, ge=1, le=MAX_EPISODES_PER_STEP,
                              description="Group size: episodes sampled per task; advantages compare them.")
    max_failing_rollouts: int = Field(
        1, ge=0, description="A group with more failing episodes (errors, timeouts) than this is dropped."
    )
    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature. The sampler's logprobs are the model's own (temperature 1, as in "
        "Tinker), so with any other value the importance ratio compares against a distribution that was not "
        "sampled; polyrl train warns about it once.",
    )
    max_turns: int = Field(8, ge=1, description="Assistant turns per episode before it is cut off.")
    max_tokens: int | None = Field(
        None, ge=1, description="Tokens sampled per turn; null = the top-level max_tokens."
    )
    reward_reduction: Literal["sum", "mean"] = Field(
        "sum", description="How an episode's step rewards combine into its reward."
    )
    nonterminal_reward: float | None = Field(
        None,
        description="Reward of an episode the environment did not finish (max_turns reached or the turn was "
        "truncated at max_tokens); null keeps the reduced step rewards.",
    )
    success_threshold: float | None = Field(
        None,
        description="An episode succeeds when its reward is at least this. null: the environment's own "
        "verdict (a final-step 'success' metric) where it gives one, else a reward of at least 1.0 (full "
        "marks), so partial credit is never a success.",
    )
    weight: float = Field(1.0, gt=0,
                          description="Relative share of each batch's groups drawn from this environment.")
    args: dict[str, Any] = Field(default_factory=dict,
                                 description="Environment-specific arguments for its builder.")
    timeout: float = Field(300, gt=0,
                           description="Seconds per episode; an episode that times out is failing.")
    partner: PartnerConfig | None = Field(
        None, description="The model playing the environment's other side (a textarena game's other seats "
        "with args.opponent: partner); null: none.")
    judge: JudgeConfig | None = Field(
        None, description="An LLM judge grading each episode against rubrics; its score is added to the "
        "reward (weight). null: the environment's own reward only.")

    @field_validator("splits", mode="before")
    @classmethod
    def _merge_split_defaults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        merged: dict[Any, Any] = {**_SPLIT_DEFAULTS, **value}
        splits = {
            name: {**_SPLIT_DEFAULTS.get(str(name), {}), **split} if isinstance(split, dict) else split
            for name, split in merged.items()
            if split is not None
        }
        if not splits:
            raise ValueError("at least one split (train or test) is needed")
        return splits
