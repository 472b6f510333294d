"""The Tinker client interface as polyrl's training path uses it: only the methods it calls.

The trainer talks to whatever ``backend`` gives it -- the official SDK's clients (hosted Tinker or
``polyrl serve``) or the in-process engine's (:mod:`polyrl.local.service`) -- through these
``Protocol`` s. They name no implementation, so both fit as they are, and so does a test's recording
fake. Each call returns a future: awaitable, with ``result()`` for blocking callers (the SDK's
``APIFuture``, the local engine's ``ClientFuture``); :class:`polyrl.backend.ServiceGuard` awaits them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator, Mapping, Protocol, Sequence, TypeVar, Union

if TYPE_CHECKING:
    from tinker import types
    from tinker.types.optimizer import OptimParamsBase

T_co = TypeVar("T_co", covariant=True)
#: An optimizer step's settings: Adam's, or Dimuon's (DimuonParams, or its base with the fields a
#: service's older DimuonParams lacks)
OptimParams = Union["types.AdamParams", "OptimParamsBase"]


class Future(Protocol[T_co]):
    """A pending answer of the service."""

    def result(self, timeout: float | None = None) -> T_co: ...

    def __await__(self) -> Generator[Any, None, T_co]: ...


class Tokenizer(Protocol):
    """The policy's tokenizer (a Hugging Face tokenizer): what the trainer and scorers ask of it."""

    def get_vocab(self) -> dict[str, int]: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]]) -> list[str]: ...


class SamplingClient(Protocol):
    """Samples from one set of weights and scores token sequences with them."""

    def sample(self, prompt: types.ModelInput, num_samples: int,
               sampling_params: types.SamplingParams) -> Future[types.SampleResponse]: ...

    def compute_logprobs(self, prompt: types.ModelInput) -> Future[list[float | None]]: ...

    def get_base_model(self) -> str: ...

    def get_tokenizer(self) -> Tokenizer: ...


class TrainingClient(Protocol):
    """One LoRA model being trained: updates, saved states, samplers of its weights."""

    model_id: str

    def get_tokenizer(self) -> Tokenizer: ...

    def forward(self, data: list[types.Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float | str] | None = None
                ) -> Future[types.ForwardBackwardOutput]: ...

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float | str] | None = None
                         ) -> Future[types.ForwardBackwardOutput]: ...

    def optim_step(self, optim_params: OptimParams) -> Future[types.OptimStepResponse]: ...

    def save_state(self, name: str) -> Future[types.SaveWeightsResponse]: ...

    def load_state_with_optimizer(self, path: str) -> Future[types.LoadWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str) -> Future[types.SaveWeightsForSamplerResponse]: ...

    def save_weights_and_get_sampling_client(self, *, record_stability_info: bool = False
                                             ) -> Future[SamplingClient]: ...

    def create_sampling_client(self, model_path: str, *,
                               record_stability_info: bool = False) -> Future[SamplingClient]: ...


class ServiceClient(Protocol):
    """The service: opens training clients (fresh, from a saved state) and samplers."""

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None, *,
                                    optimizer: Any = None) -> Future[TrainingClient]: ...

    def create_training_client_from_state(self, path: str, *,
                                          optimizer: Any = None) -> Future[TrainingClient]: ...

    def create_training_client_from_state_with_optimizer(self, path: str) -> Future[TrainingClient]: ...

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[SamplingClient]: ...


class RestClient(Protocol):
    """Checkpoint bookkeeping: the checkpoints of a training run, and deleting one."""

    def list_checkpoints(self, training_run_id: str) -> Future[types.CheckpointsListResponse]: ...

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> Future[None]: ...
