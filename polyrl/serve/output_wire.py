"""A ``ForwardBackwardOutput`` on the wire: the protobuf the SDK decodes (``response_conv``: one
``ArrayRecord`` of per-datum arrays per run of datums whose outputs share their trailing shapes) and the
JSON a client that does not ask for protobuf gets."""

from __future__ import annotations

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

_OUT_DTYPES = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """``ForwardBackwardOutput`` as one ``ArrayRecord`` of per-datum arrays (what the SDK decodes)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    outputs = out.loss_fn_outputs
    names = list(outputs[0]) if outputs else []
    trailing = [tuple(tuple(o[name].to_numpy().shape[1:]) for name in names) for o in outputs]
    start = 0
    while start < len(outputs):  # one record per run of datums whose outputs share their trailing shapes
        end = start + 1
        while end < len(outputs) and trailing[end] == trailing[start]:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=out.loss_fn_output_type or "ArrayRecord",
                                         num_datums=end - start)
        for name in names:
            arrays = [np.ascontiguousarray(o[name].to_numpy()) for o in outputs[start:end]]
            dtype = np.dtype(np.float32) if arrays[0].dtype.kind == "f" else np.dtype(np.int64)
            arrays = [a.astype(dtype, copy=False) for a in arrays]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = _OUT_DTYPES[dtype]
            bt.trailing_shape.extend(arrays[0].shape[1:])
        start = end
    if not outputs:
        msg.loss_fn_outputs.add(type_tag=out.loss_fn_output_type or "ArrayRecord", num_datums=0)
    return msg.SerializeToString()


def forward_backward_output_json(out: types.ForwardBackwardOutput) -> dict:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "loss_fn_outputs": [{k: {"data": td.to_numpy().reshape(-1).tolist(), "dtype": td.dtype,
                                 "shape": list(td.to_numpy().shape)} for k, td in o.items()}
                            for o in out.loss_fn_outputs],
        "metrics": dict(out.metrics),
    }
