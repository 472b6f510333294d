"""A ``SampleResponse`` on the wire: the protobuf the SDK decodes (``response_conv``) and the JSON a
client that does not ask for protobuf gets. Top-K rows are dense ``(length, K)`` matrices with Tinker's
filler (token 0, logprob -99999) where nothing was scored; tensors go dense or sparse (CSR) as the
request sent them."""

from __future__ import annotations

import math

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb


def _topk_pb(msg: pb.TopkLogprobs, topk) -> None:
    ids, lps = np.asarray(topk.token_ids, dtype=np.int32), np.asarray(topk.logprobs, dtype=np.float32)
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()
    msg.length, msg.k = ids.shape


def _tensor_pb(msg: pb.Tensor, td: types.TensorData) -> None:
    np_dtype = np.float32 if td.dtype == "float32" else np.int64
    msg.dtype = pb.DTYPE_FLOAT32 if td.dtype == "float32" else pb.DTYPE_INT64
    msg.shape.extend(td.shape or [])
    values = np.asarray(td.data if td.sparse_crow_indices is not None else td.to_numpy(), dtype=np_dtype)
    if td.sparse_crow_indices is not None:
        msg.sparse_csr.values = values.tobytes()
        msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, dtype=np.int64).tobytes()
        msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, dtype=np.int64).tobytes()
    else:
        msg.dense = values.tobytes()


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    """A ``SampleResponse`` as the SDK's protobuf (top-K as dense matrices, tensors dense or sparse as
    the request sent them)."""
    msg = pb.SampleResponse()
    for seq in resp.sequences:
        stop = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s = msg.sequences.add(stop_reason=stop)
        s.tokens = np.asarray(seq.tokens_np, dtype=np.int32).tobytes()
        if seq.logprobs_np is not None:
            s.logprobs = np.asarray(seq.logprobs_np, dtype=np.float32).tobytes()
        if seq.topk_logprobs_np is not None:
            _topk_pb(s.topk_sampled_logprobs, seq.topk_logprobs_np)
    if resp.prompt_logprobs_np is not None:
        msg.prompt_logprobs = np.asarray(resp.prompt_logprobs_np, dtype=np.float32).tobytes()
    if resp.topk_prompt_logprobs_np is not None:
        _topk_pb(msg.topk_prompt_logprobs, resp.topk_prompt_logprobs_np)
    if resp.target_prompt_logprobs is not None:
        _tensor_pb(msg.target_prompt_logprobs, resp.target_prompt_logprobs)
    if resp.prompt_alt_tokens is not None:
        _tensor_pb(msg.prompt_alt_tokens.tokens, resp.prompt_alt_tokens.tokens)
        _tensor_pb(msg.prompt_alt_tokens.logprobs, resp.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def _tensor_json(td: types.TensorData | None) -> dict | None:
    if td is None:
        return None
    sparse = td.sparse_crow_indices is not None
    out = {"data": td.data if sparse else td.to_numpy().reshape(-1).tolist(), "dtype": td.dtype,
           "shape": list(td.shape or [])}
    if sparse:
        out["sparse_crow_indices"] = list(td.sparse_crow_indices)
        out["sparse_col_indices"] = list(td.sparse_col_indices)
    return out


def sample_response_json(resp: types.SampleResponse, sequence_ids: list[str]) -> dict:
    plp = resp.prompt_logprobs_np
    return {
        "type": "sample",
        "sequences": [{"stop_reason": s.stop_reason, "sequence_id": sid,
                       "tokens": np.asarray(s.tokens_np).tolist(),
                       "logprobs": None if s.logprobs_np is None else np.asarray(s.logprobs_np).tolist(),
                       "topk_logprobs": s.topk_logprobs}
                      for s, sid in zip(resp.sequences, sequence_ids)],
        "prompt_logprobs": None if plp is None else [None if math.isnan(x) else float(x) for x in plp],
        "topk_prompt_logprobs": resp.topk_prompt_logprobs,
        "target_prompt_logprobs": _tensor_json(resp.target_prompt_logprobs),
        "prompt_alt_tokens": None if resp.prompt_alt_tokens is None else {
            "tokens": _tensor_json(resp.prompt_alt_tokens.tokens),
            "logprobs": _tensor_json(resp.prompt_alt_tokens.logprobs)},
    }
