"""Tinker's wire formats in: JSON request bodies and protobuf ``forward_backward`` requests.

Protobuf messages are the SDK's own (``tinker.proto.tinker_public_pb2``); the decodings mirror the
SDK's ``request_conv`` (what it sends); results go out through :mod:`polyrl.serve.output_wire`
(``forward_backward``) and :mod:`polyrl.serve.sample_wire` (``SampleResponse``). JSON bodies are
validated with small models that ignore unknown keys (a newer SDK may send more) and reuse the
SDK's own types for the nested parts (``ModelInput``, ``SamplingParams``, ``AdamParams``, ``LoraConfig``).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from polyrl import images
from polyrl.local.optim import DimuonSettings, check_adam


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with ``{"error": message, "category": ...}``.
    ``retry_after`` (seconds) goes out as a ``Retry-After`` header, for a refusal that passes (429)."""

    def __init__(self, status: int, message: str, category: str = "user", retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.category = category
        self.retry_after = retry_after


# ---- JSON requests ---------------------------------------------------------------------------------
Seq = Annotated[int, Field(ge=0, lt=2**63)]  # the SDK's counters; protobuf's int64 bounds them too


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _check(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{field} must be {rule}, got {value!r}")


class CreateSessionReq(_Req):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionReq(_Req):
    session_id: str


class CreateModelReq(_Req):
    session_id: str
    model_seq_id: Seq
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: types.LoraConfig | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelReq(_Req):
    model_id: str


class LoadWeightsReq(_Req):
    path: str
    optimizer: bool = False
    # create a training client from a checkpoint ...
    session_id: str | None = None
    model_seq_id: Seq | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    # ... or load into an existing one (legacy load_state)
    model_id: str | None = None
    seq_id: Seq | None = None
    weights_access_token: str | None = None  # another key, to load a checkpoint it may read


class OptimStepReq(_Req):
    model_id: str
    seq_id: Seq
    adam_params: types.AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _sane(self) -> "OptimStepReq":
        """Adam's hyperparameters out of their ranges (:mod:`polyrl.optim_ranges`) are refused here, with
        one line naming each field and its range (Dimuon's: :func:`optim_settings`)."""
        if self.adam_params is not None:
            check_adam(self.adam_params)
        return self


class SaveWeightsReq(_Req):
    model_id: str
    seq_id: Seq
    path: str | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveForSamplerReq(_Req):
    model_id: str
    seq_id: Seq
    path: str | None = None
    sampling_session_seq_id: Seq | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class CreateSamplingSessionReq(_Req):
    session_id: str
    sampling_session_seq_id: Seq
    base_model: str | None = None
    model_path: str | None = None


class SampleReq(_Req):
    sampling_session_id: str | None = None
    seq_id: Seq | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: int = Field(1, ge=1, le=4096)
    prompt: types.ModelInput
    sampling_params: types.SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _images(cls, data: Any) -> Any:
        """Each image chunk of the prompt said wrong in its own words: the SDK's chunk union would
        report every other chunk type's missing fields instead."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
        for k, chunk in enumerate(chunks if isinstance(chunks, list) else []):
            if isinstance(chunk, dict) and chunk.get("type") == "image":
                check_image_json(chunk, f"prompt chunk {k}")
        return data

    @model_validator(mode="after")
    def _sane(self) -> "SampleReq":
        p = self.sampling_params
        _check(math.isfinite(p.temperature) and p.temperature >= 0, "sampling_params.temperature",
               "a finite number >= 0", p.temperature)
        _check(0 < p.top_p <= 1, "sampling_params.top_p", "in (0, 1]", p.top_p)
        _check(-1 <= p.top_k < 2**31, "sampling_params.top_k", "-1 (no limit), 0 or a positive count",
               p.top_k)
        _check(p.max_tokens is None or 1 <= p.max_tokens < 2**31, "sampling_params.max_tokens",
               "a positive count", p.max_tokens)
        _check(p.seed is None or -(2**63) <= p.seed < 2**64, "sampling_params.seed", "a 64-bit integer",
               p.seed)
        return self


class RetrieveFutureReq(_Req):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoReq(_Req):
    tinker_path: str


class SaveExternalReq(_Req):
    model_id: str
    seq_id: Seq
    path: str
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class SetTtlReq(_Req):
    ttl_seconds: int | None = None


class CopyWeightsReq(_Req):
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: Seq | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


R = TypeVar("R", bound=BaseModel)


class _NotANumber(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NotANumber(f"request body holds {name}, which is not a JSON number; send finite numbers")


def parse_json(model: type[R], body: bytes) -> R:
    """Validate a JSON body; any problem is a 400 naming the offending fields."""
    try:
        data = json.loads(body or b"null", parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    except _NotANumber as e:
        raise RequestError(400, str(e)) from None
    except ValueError:  # an integer of thousands of digits
        raise RequestError(400, "request body holds a number too large to read") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:  # strict: a bool or a string is never a number (a JSON integer still fills a float field)
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise RequestError(400, f"invalid request body: {_summarize(e, data)}") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None


def peek_json_ids(body: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body that failed validation, when both are readable."""
    try:
        data = json.loads(body)
        model_id, seq_id = data["model_id"], data["seq_id"]
    except Exception:  # noqa: BLE001
        return None
    ok = (isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool)
          and seq_id >= 1)
    return (model_id, seq_id) if ok else None


def _summarize(e: ValidationError, data: Any = None, limit: int = 3) -> str:
    """One line of a validation's first errors, each ``field: problem`` (a validator's own message, which
    names its field, alone)."""
    errors = _one_member(e.errors(), data)
    parts = []
    for err in errors[:limit]:
        where, message = ".".join(str(x) for x in err["loc"]), err["msg"].removeprefix("Value error, ")[:300]
        own = not where and err["type"] == "value_error"
        parts.append(message if own else f"{where or 'body'}: {message}")
    if len(errors) > limit:
        parts.append(f"... {len(errors) - limit} more")
    return "; ".join(parts)


def _members(annotation: Any) -> list[type[BaseModel]]:
    """The models of a (nested, annotated) union."""
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += [arg] if isinstance(arg, type) and issubclass(arg, BaseModel) else _members(arg)
    return out


_CHUNK_TYPES = {cls.__name__: cls.model_fields["type"].default
                for cls in _members(types.ModelInput.model_fields["chunks"].annotation)}


def _one_member(errors: list[dict], data: Any) -> list[dict]:
    """``errors`` with a chunk's narrowed to the chunk type its ``type`` names: pydantic reports a chunk
    that fits no member of the union once per member, and the first of those is rarely the one meant."""
    out, unknown = [], set()
    for err in errors:
        loc = list(err["loc"])
        at = next((i for i, x in enumerate(loc) if x in _CHUNK_TYPES), None)
        if at is None:
            out.append(err)
            continue
        where, chunk = tuple(loc[:at]), data
        for key in where:
            chunk = chunk[key] if isinstance(chunk, (dict, list)) and _has(chunk, key) else None
        declared = chunk.get("type") if isinstance(chunk, dict) else None
        if declared in _CHUNK_TYPES.values():
            if _CHUNK_TYPES[loc[at]] == declared:
                out.append({**err, "loc": (*where, *loc[at + 1:])})
        elif where not in unknown:
            unknown.add(where)
            kinds = ", ".join(repr(t) for t in _CHUNK_TYPES.values())
            given = "none is given" if declared is None else f"not {str(declared)[:40]!r}"
            out.append({**err, "loc": where, "type": "chunk_type",
                        "msg": f"a chunk's type is one of {kinds}; {given}"})
    return out


def _has(container: dict | list, key: Any) -> bool:
    return key in container if isinstance(container, dict) else isinstance(key, int) and key < len(container)


def tensor_from_json(value: Any, field: str, max_values: int) -> types.TensorData:
    """A ``TensorData`` sent as JSON (``{data, dtype, shape, sparse_crow_indices, sparse_col_indices}``),
    its declared size checked against ``max_values`` before anything of that size is allocated."""
    if not isinstance(value, dict):
        raise RequestError(400, f"{field} must be a tensor object (data, dtype, shape), got "
                                f"{type(value).__name__}")
    try:
        td = _TensorJson.model_validate(value, strict=True)
    except ValidationError as e:
        raise RequestError(400, f"invalid {field}: {_summarize(e)}") from None
    if any(n < 0 for n in td.shape) or math.prod(td.shape) > max_values:
        raise RequestError(400, f"{field} declares shape {td.shape}; this server takes at most {max_values} "
                                "values per tensor")
    crow, col = td.sparse_crow_indices, td.sparse_col_indices
    sparse = crow is not None or col is not None
    if sparse and not (len(td.shape) == 2 and crow is not None and col is not None and _valid_csr(
            np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64), len(td.data), td.shape)):
        raise RequestError(400, f"{field} is not a valid sparse (CSR) 2-D tensor of shape {td.shape}")
    if not sparse and len(td.data) != math.prod(td.shape):
        raise RequestError(400, f"{field} has {len(td.data)} values but shape {td.shape}")
    return types.TensorData(data=np.asarray(td.data, dtype=np.int64 if td.dtype == "int64" else np.float32),
                            dtype=td.dtype, shape=list(td.shape), sparse_crow_indices=td.sparse_crow_indices,
                            sparse_col_indices=td.sparse_col_indices)


class _TensorJson(_Req):
    data: list[Annotated[int, Field(ge=-(2**63), lt=2**63)]] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[Annotated[int, Field(ge=0, lt=2**31)]]
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


def optim_settings(req: "OptimStepReq") -> types.AdamParams | DimuonSettings:
    """The step's hyperparameters: ``adam_params``, or Dimuon's ``optimizer_params`` (a 400 naming the
    field for anything else)."""
    if req.adam_params is not None:
        return req.adam_params
    params = req.optimizer_params or {}
    if params.get("type") != "dimuon":
        raise RequestError(400, f"optimizer params of type {params.get('type', 'none given')!r} are not "
                                "supported; pass tinker.types.AdamParams or tinker.types.DimuonParams")
    try:
        return DimuonSettings.of(params)
    except ValueError as e:
        raise RequestError(400, str(e)) from None


# ---- forward_backward requests (protobuf) ---------------------------------------------------------
_NP_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_TENSOR_DTYPES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int64"}


@dataclass
class ForwardBackwardReq:
    model_id: str
    seq_id: int
    data: list[types.Datum]
    loss_fn: str
    loss_fn_config: dict[str, Any]
    forward_only: bool
    tokens: int = 0  # model_input tokens of all datums


VALUES_PER_TOKEN = 8


@dataclass(frozen=True)
class RequestLimits:
    """What one ``forward_backward`` request may hold; checked on the protobuf's declared sizes, before
    anything is decoded, so a small body cannot make the server allocate a large tensor."""

    max_tokens: int = 1 << 20  # model_input tokens of all datums
    max_datums: int = 1024
    max_k: int = 128  # K of an (N, K) loss input, such as top-K targets
    max_images: int = 64  # images of all datums (or of one prompt)
    max_image_bytes: int = images.MAX_IMAGE_BYTES  # one encoded image
    max_image_pixels: int = images.MAX_IMAGE_PIXELS  # one image's declared width x height

    @property
    def max_values(self) -> int:
        """Loss-input values of all datums, sparse tensors counted at their dense size."""
        return VALUES_PER_TOKEN * self.max_tokens


def peek_forward_backward_ids(body: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a ``ForwardBackwardRequest`` whose data cannot be decoded, if readable."""
    try:
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(body)
        return (msg.model_id, msg.seq_id) if msg.model_id else None
    except Exception:  # noqa: BLE001
        return None


def decode_forward_backward(body: bytes, limits: RequestLimits = RequestLimits()) -> ForwardBackwardReq:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise RequestError(400, "forward_backward body is not a tinker_public.ForwardBackwardRequest "
                                f"protobuf: {e}") from None
    if not msg.model_id:
        raise RequestError(400, "forward_backward request has no model_id")
    if msg.seq_id < 1:
        raise RequestError(400, f"forward_backward request needs a seq_id >= 1, got {msg.seq_id}")
    if msg.loss_fn_config_v2:
        config = {k: (v.text if v.WhichOneof("value") == "text" else v.number)
                  for k, v in msg.loss_fn_config_v2.items()}
    else:
        config = dict(msg.loss_fn_config)
    for k, v in config.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise RequestError(400, f"loss_fn_config[{k!r}] is {v}; it must be a finite number")
    if len(msg.data) > limits.max_datums:
        raise RequestError(400, f"forward_backward request holds {len(msg.data)} datums; this server takes "
                                f"at most {limits.max_datums} per request (--max-request-datums)")
    tokens = values = pictures = 0
    for i, d in enumerate(msg.data):
        try:
            n, v, k = _datum_size(d, limits)
        except ValueError as e:
            raise RequestError(413 if isinstance(e, _TooLarge) else 400, f"data[{i}]: {e}") from None
        tokens, values, pictures = tokens + n, values + v, pictures + k
        if pictures > limits.max_images:
            raise RequestError(400, f"forward_backward request holds more than {limits.max_images} images; "
                                    f"this server takes at most {limits.max_images} per request "
                                    "(--max-request-images)")
    if tokens > limits.max_tokens:
        raise RequestError(400, f"forward_backward request holds {tokens} tokens; this server takes at most "
                                f"{limits.max_tokens} per request (--max-request-tokens)")
    if values > limits.max_values:
        raise RequestError(400, f"forward_backward request's loss_fn_inputs hold {values} values (sparse "
                                f"ones counted dense); this server takes at most {limits.max_values} per "
                                f"request ({VALUES_PER_TOKEN} per token of --max-request-tokens)")
    data = []
    for i, d in enumerate(msg.data):
        try:
            data.append(_decode_datum(d))
        except (ValueError, TypeError) as e:
            raise RequestError(400, f"data[{i}]: {e}") from None
    return ForwardBackwardReq(msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only, tokens)


class _TooLarge(ValueError):
    """An image past the server's bytes or pixels bound (413)."""


IMAGE_FORMATS: tuple[str, ...] = typing.get_args(types.ImageChunk.model_fields["format"].annotation)


def check_image_format(fmt: Any, where: str) -> None:
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"{where}: image format {str(fmt)[:40]!r} is not supported (supported: "
                         f"{', '.join(repr(f) for f in IMAGE_FORMATS)})")


def check_expected_tokens(value: Any, where: str) -> int:
    if value is None:
        raise ValueError(f"{where}: an ImageChunk needs expected_tokens (the image's token count)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: expected_tokens must be a positive count, got {str(value)[:40]}")
    return value


def check_image_json(chunk: dict, where: str) -> None:
    """A JSON image chunk's format, base64 data and expected_tokens, each a ValueError naming it."""
    check_image_format(chunk.get("format"), where)
    data = chunk.get("data")
    try:
        if not isinstance(data, str):
            raise ValueError
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: image data is not valid base64 (send the image's bytes base64-encoded)"
                         ) from None
    check_expected_tokens(chunk.get("expected_tokens"), where)


def check_image(data: bytes, fmt: str, expected_tokens: int | None, limits: RequestLimits, where: str) -> int:
    """An image chunk's token count, once its format (declared, and the bytes' signature), declared size
    and bytes are within ``limits`` (from the header alone: nothing is decoded); a ValueError naming the
    problem otherwise."""
    check_image_format(fmt, where)
    check_expected_tokens(expected_tokens, where)
    try:
        images.check_header(data, images.ImageLimits(limits.max_image_bytes, limits.max_image_pixels), fmt)
    except images.ImageError as e:
        too_large = "more than max_image" in str(e)
        flag = " (--max-image-bytes / --max-image-pixels)" if too_large else ""
        raise (_TooLarge if too_large else ValueError)(f"{where}: {e}{flag}") from None
    return int(expected_tokens)


def check_prompt_images(model_input: types.ModelInput, limits: RequestLimits, where: str = "prompt") -> None:
    """The images of a JSON request's ``ModelInput`` within ``limits``: a RequestError (400, 413) naming
    the first problem; an ``ImageAssetPointerChunk`` (an asset this server has no store for) is refused."""
    found = [c for c in model_input.chunks if getattr(c, "type", None) != "encoded_text"]
    if len(found) > limits.max_images:
        raise RequestError(400, f"{where} holds {len(found)} images; this server takes at most "
                                f"{limits.max_images} per request (--max-request-images)")
    for k, chunk in enumerate(model_input.chunks):
        if chunk.type == "image_asset_pointer":
            raise RequestError(400, f"{where} chunk {k} is an image_asset_pointer; polyrl serve has no asset "
                                    "store: send the image's bytes as an ImageChunk")
        if chunk.type == "image":
            try:
                check_image(chunk.data, chunk.format, chunk.expected_tokens, limits, f"{where} chunk {k}")
            except ValueError as e:
                raise RequestError(413 if isinstance(e, _TooLarge) else 400, str(e)) from None


def _datum_size(d: pb.Datum, limits: RequestLimits) -> tuple[int, int, int]:
    """(tokens, loss-input values, images) of a datum, from what its protobuf declares; a ValueError for a
    shape that does not fit the datum. Nothing is decoded or allocated here (an image's header is read)."""
    n = pictures = 0
    for k, c in enumerate(d.model_input):
        kind = c.WhichOneof("chunk")
        if kind == "image":
            image = c.image
            tokens = image.expected_tokens if image.HasField("expected_tokens") else None
            n += check_image(image.data, image.format, tokens, limits, f"model_input chunk {k}")
            pictures += 1
            continue
        if kind != "encoded_text":
            raise ValueError(f"model_input has a {kind or 'empty'} chunk; this server takes text and image "
                             "chunks")
        size = len(c.encoded_text.tokens)
        if size % 4:
            raise ValueError(f"model_input tokens are {size} bytes, not a whole number of int32s")
        n += size // 4
    if n == 0:  # every datum costs at least a token, so the limits on tokens bound datums too
        raise ValueError("model_input is empty")
    return n, sum(_tensor_size(name, t, n, limits.max_k) for name, t in d.loss_fn_inputs.items()), pictures


def _tensor_size(name: str, t: pb.Tensor, n: int, max_k: int) -> int:
    """The dense size of a loss input that is (n,) or (n, K) with 1 <= K <= max_k."""
    field = f"loss_fn_inputs[{name!r}]"
    if t.dtype not in _NP_DTYPES:
        dtype = pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype
        raise ValueError(f"{field} has unsupported dtype {dtype}")
    shape = list(t.shape)
    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise ValueError(f"{field} is sparse but declares shape {shape}; a sparse loss input is 2-D: "
                             "(tokens, K)")
    elif not shape:
        shape = [len(t.dense) // np.dtype(_NP_DTYPES[t.dtype]).itemsize]
    if len(shape) > 2 or shape[0] != n:
        raise ValueError(f"{field} declares shape {shape}; a loss input is (N,) or (N, K) with N the datum's "
                         f"{n} tokens")
    if len(shape) == 2 and not 1 <= shape[1] <= max_k:
        raise ValueError(f"{field} declares shape {shape}; its K (second dimension) must be between 1 and "
                         f"{max_k} (--max-target-k)")
    return math.prod(shape)


def _valid_csr(crow: np.ndarray, col: np.ndarray, nnz: int, shape: list[int]) -> bool:
    """The invariants torch checks when it densifies a CSR tensor (a failure there would be the server's)."""
    rows, cols = shape
    if len(crow) != rows + 1 or len(col) != nnz or crow[0] != 0 or crow[-1] != nnz:
        return False
    if (np.diff(crow) < 0).any():
        return False
    if nnz == 0:
        return True
    if col.min() < 0 or col.max() >= cols:
        return False
    same_row = np.ones(nnz - 1, dtype=bool)  # col[j] and col[j + 1] lie in one row
    starts = crow[1:-1]
    same_row[starts[(starts > 0) & (starts < nnz)] - 1] = False
    return bool((np.diff(col)[same_row] > 0).all())


def _decode_datum(d: pb.Datum) -> types.Datum:
    chunks = [types.ImageChunk(data=c.image.data, format=c.image.format,
                               expected_tokens=c.image.expected_tokens)
              if c.WhichOneof("chunk") == "image" else
              types.EncodedTextChunk(tokens=np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist())
              for c in d.model_input]
    inputs = {name: _decode_tensor(name, t) for name, t in d.loss_fn_inputs.items()}
    n = sum(c.length for c in chunks)
    spans = {}
    for name in ("model_input_spans", "loss_fn_input_spans"):
        given = getattr(d, name)
        spans[name] = [_decode_span(name, k, x) for k, x in enumerate(given)] if len(given) else None
        if spans[name] is not None and len(spans[name]) > n:
            raise ValueError(f"{name} holds {len(spans[name])} spans for {n} positions")
    if (spans["model_input_spans"] is None) != (spans["loss_fn_input_spans"] is None):
        raise ValueError("provenance comes as a pair: model_input_spans and loss_fn_input_spans, or neither")
    return types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs, **spans)


MAX_SEQUENCE_ID_CHARS = 128


def _decode_span(name: str, k: int,
                 span: pb.ProvenanceSpan) -> types.PromptProvenanceSpan | types.SampledProvenanceSpan:
    kind = span.WhichOneof("span")
    if kind is None:
        raise ValueError(f"{name}[{k}] is an empty provenance span")
    x = getattr(span, kind)
    if not 0 < len(x.sequence_id) <= MAX_SEQUENCE_ID_CHARS:
        raise ValueError(f"{name}[{k}].sequence_id must be 1 to {MAX_SEQUENCE_ID_CHARS} characters")
    if x.offset < 0 or x.length < 0:
        raise ValueError(f"{name}[{k}] has offset {x.offset} and length {x.length}; both must be >= 0")
    cls = types.PromptProvenanceSpan if kind == "prompt_tokens" else types.SampledProvenanceSpan
    return cls(sequence_id=x.sequence_id, offset=x.offset, length=x.length)


def _decode_tensor(name: str, t: pb.Tensor) -> types.TensorData:
    """A loss input whose declared shape :func:`_tensor_size` accepted."""
    np_dtype, dtype = _NP_DTYPES[t.dtype], _TENSOR_DTYPES[t.dtype]
    shape = list(t.shape) or None
    field = f"loss_fn_inputs[{name!r}]"
    if t.HasField("sparse_csr"):
        csr = t.sparse_csr
        values = np.frombuffer(csr.values, dtype=np_dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if not _valid_csr(crow, col, len(values), shape):
            raise ValueError(f"{field} is not a valid sparse (CSR) tensor of shape {shape}: it needs "
                             f"{shape[0] + 1} row offsets rising from 0 to its number of values, and per "
                             "value a column in [0, K), increasing within each row")
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise ValueError(f"{field} holds values that are not finite (NaN or infinity)")
        return types.TensorData(data=values, dtype=dtype, shape=shape, sparse_crow_indices=crow.tolist(),
                                sparse_col_indices=col.tolist())
    arr = np.frombuffer(t.dense, dtype=np_dtype)
    if shape is not None and math.prod(shape) != arr.size:
        raise ValueError(f"{field} has {arr.size} values but shape {shape}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():  # one NaN would poison the adapter's weights
        raise ValueError(f"{field} holds values that are not finite (NaN or infinity)")
    return types.TensorData(data=arr, dtype=dtype, shape=shape)
