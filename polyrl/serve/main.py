"""``polyrl serve``: command-line options, API keys, and the uvicorn server.

Problems with the options (a port out of range or in use, a missing model directory or key file)
are :class:`~polyrl.errors.UserInputError`: one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from polyrl.config.schema import DEFAULT_MICRO_BATCH_TOKENS
from polyrl.errors import UserInputError

if TYPE_CHECKING:
    from polyrl.serve.server import ServeConfig

KEYS_ENV = "POLYRL_SERVE_API_KEYS"
LIMITS = [  # (flag, default, help): past a per-request limit 400, past a key's in-flight limit 429 (retried)
    ("--max-request-tokens", 1 << 20, "model_input tokens in one forward_backward request, or one prompt"),
    ("--max-request-datums", 1024, "datums in one forward_backward request (the SDK splits larger batches)"),
    ("--max-target-k", 128, "largest K of an (N, K) loss input, such as top-K targets, and of a sampling "
                            "request's top-K, target or alternative-token logprobs"),
    ("--max-request-images", 64, "images in one forward_backward request, or one prompt"),
    ("--max-image-bytes", 20 << 20, "encoded bytes of one image (413 past it)"),
    ("--max-image-pixels", 36_000_000, "declared width x height of one image, read from its header before "
                                       "anything is decoded (413 past it)"),
    ("--max-tokens-in-flight", 1 << 22, "per key: forward_backward and prompt tokens accepted, not yet done "
                                        "(one forward_backward call's chunks must fit in it together)"),
    ("--max-samples-in-flight", 8192, "per key: samples (num_samples) of sampling requests not yet done"),
    ("--max-decode-tokens-in-flight", 1 << 21, "per key: tokens its sampling requests not yet done may "
                                               "decode (num_samples x max_tokens, max_tokens capped by the "
                                               "model's context)"),
    ("--max-sessions", 256, "per key: live sessions (a closed or timed-out one frees its place)"),
    ("--max-models", 64, "per key: live training clients (freed when their session ends)"),
    ("--max-adapter-bytes", 4 << 30, "per key: memory of its training clients' adapters, gradients and "
                                     "optimizer state (16 bytes per LoRA parameter)"),
    ("--max-lora-rank", 256, "largest LoRA rank of a training client (also at most the model's width)"),
    ("--max-checkpoints", 1000, "per key: checkpoints kept in the store; past it a save gets 403 until some "
                                "are deleted"),
    ("--max-recorded-tokens", 1 << 24, "per key: prompt and sampled tokens of the sequences its samplers "
                                       "recorded for stable_reinforce (record_stability_info); past it the "
                                       "least recently used are evicted"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000,
                   help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--models", nargs="*", default=[], metavar="DIR_OR_ID",
                   help="base models to serve (model directories, .gguf files or hub ids); none: any the "
                        "engine can load")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accepted X-API-Key (repeatable; also --api-key-file and ${KEYS_ENV}). The tinker "
                        "SDK only sends keys starting with 'tml-'. None given: one is generated and printed")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="file of accepted keys, one per line ('#' comments)")
    p.add_argument("--store-dir",
                   help="checkpoint store (default: $POLYRL_STORE_DIR or ~/.cache/polyrl/store)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the learner's dtype (adapters and optimizer stay float32); auto: bfloat16 on GPUs "
                        "and on CPUs with native bfloat16 arithmetic, else float32")
    p.add_argument("--sampler-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype sampling computes in, apart from training (a copy of the weights); auto: "
                        "bfloat16 on GPUs and on CPUs with native bfloat16 arithmetic, else --dtype's")
    p.add_argument("--sampler", default="auto", choices=["auto", "polyrl", "vllm"],
                   help="what samples: polyrl's own sampler, vLLM (started from --vllm-python, or the "
                        "servers of --vllm-url; only LoRA adapters cross over), or auto: vLLM with "
                        "--vllm-url or on a CUDA device with --vllm-python present, else polyrl's own")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python", metavar="PATH",
                   help="interpreter of an environment with vLLM (`make vllm` builds .venv-vllm)")
    p.add_argument("--vllm-url", action="append", default=[], metavar="URL",
                   help="a vLLM server that already runs the base model (repeatable; requests spread over "
                        "them, one that stops answering is dropped)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, metavar="N",
                   help=f"tokens per forward/backward pass (default: {DEFAULT_MICRO_BATCH_TOKENS} on a CPU, "
                        "4096 per 20 GiB of a GPU's memory up to 16384); lower it if training runs out of "
                        "memory")
    p.add_argument("--gradient-checkpointing", choices=["auto", "true", "false"], default="auto",
                   help="recompute activations in backward to save memory (auto: on for models of 300M+ "
                        "parameters)")
    p.add_argument("--attention", choices=["auto", "dense", "tree", "flex"], default="auto",
                   help="how packed training rows attend (auto: tree on a CPU, dense mask on a GPU; flex: "
                        "FlexAttention over the rows' prefix trees, compiled on CUDA)")
    p.add_argument("--max-body-mb", type=float, default=64.0,
                   help="largest accepted request body (413 above)")
    p.add_argument("--long-poll", type=float, default=30.0, help="seconds retrieve_future waits before a 408")
    p.add_argument("--seq-gap-timeout", type=float, default=120.0,
                   help="seconds a training operation waits for a missing earlier seq_id before it is failed")
    p.add_argument("--sample-gather-ms", type=float, default=10.0,
                   help="while the engine is idle, hold sampling requests until none arrived for this long "
                        "(3x once several wait, at most 100x in all) so a rollout's requests decode in one "
                        "batch; 0: off")
    p.add_argument("--no-preload", action="store_true", help="load models on first use, not at start-up")
    p.add_argument("--sweep-interval", type=float, default=60.0, metavar="S",
                   help="seconds between sweeps that remove expired checkpoints (saved with a TTL) from the "
                        "store; an expired one is never served meanwhile (default 60)")
    limits = p.add_argument_group("limits", "what one request, and one API key, may take (so that no key "
                                            "starves the others)")
    for flag, default, text in LIMITS:
        limits.add_argument(flag, type=int, default=default, metavar="N", help=f"{text} (default {default})")
    limits.add_argument("--max-store-bytes", type=int, default=None, metavar="N",
                        help="cap on the bytes the checkpoint store holds; past it a save gets 403 until "
                             "checkpoints are deleted or expire (default: no cap)")
    limits.add_argument("--header-timeout", type=float, default=30.0, metavar="S",
                        help="seconds a request's headers may take to arrive; slower clients are closed "
                             "(default 30)")
    limits.add_argument("--body-timeout", type=float, default=120.0, metavar="S",
                        help="seconds a request's body may take to arrive after its headers (default 120)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def api_keys(args: argparse.Namespace) -> tuple[list[str], bool]:
    """Accepted keys from the options, the key file and the environment; (keys, generated)."""
    keys = list(args.api_key)
    if args.api_key_file:
        try:
            text = Path(args.api_key_file).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not a text file"
            raise UserInputError(f"--api-key-file {args.api_key_file}: {why}") from None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    keys += os.environ.get(KEYS_ENV, "").replace(",", " ").split()
    if keys:
        return list(dict.fromkeys(keys)), False
    return [f"tml-local-{secrets.token_urlsafe(18)}"], True


def config_from_args(args: argparse.Namespace, keys: list[str]) -> "ServeConfig":
    from polyrl.config.schema import LocalEngineConfig, VllmConfig
    from polyrl.errors import UserInputError
    from polyrl.serve.server import ServeConfig

    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 1:
        raise UserInputError(f"--micro-batch-tokens must be a positive integer, got "
                             f"{args.micro_batch_tokens}")
    checkpointing = {"auto": "auto", "true": True, "false": False}[args.gradient_checkpointing]
    local = LocalEngineConfig(store_dir=args.store_dir, device=args.device, dtype=args.dtype,
                              sampler_dtype=args.sampler_dtype,
                              micro_batch_tokens=args.micro_batch_tokens or "auto",
                              gradient_checkpointing=checkpointing, max_store_bytes=args.max_store_bytes,
                              attention=args.attention,
                              sampler=args.sampler,
                              vllm=VllmConfig(python=args.vllm_python, urls=args.vllm_url))
    return ServeConfig(models=list(args.models), api_keys=keys, local=local,
                       max_body_bytes=int(args.max_body_mb * (1 << 20)),
                       long_poll_s=args.long_poll, gap_timeout_s=args.seq_gap_timeout,
                       sample_quiet_ms=args.sample_gather_ms, preload=not args.no_preload,
                       max_request_tokens=args.max_request_tokens, max_request_datums=args.max_request_datums,
                       max_target_k=args.max_target_k, max_request_images=args.max_request_images,
                       max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                       max_tokens_in_flight=args.max_tokens_in_flight,
                       max_samples_in_flight=args.max_samples_in_flight,
                       max_decode_tokens_in_flight=args.max_decode_tokens_in_flight,
                       max_sessions=args.max_sessions, max_models=args.max_models,
                       max_adapter_bytes=args.max_adapter_bytes, max_lora_rank=args.max_lora_rank,
                       max_checkpoints=args.max_checkpoints,
                       max_recorded_tokens=args.max_recorded_tokens, sweep_interval_s=args.sweep_interval,
                       header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_args(args: argparse.Namespace) -> None:
    """Refuse options that cannot work, before the port is bound or anything heavy is loaded."""
    from polyrl.models import resolve_model_path
    from polyrl.samplers import check_python

    if not 0 <= args.port <= 65535:
        raise UserInputError(f"--port {args.port} is not a port number (0 to 65535; 0: any free port)")
    if not 0 < args.long_poll < 45:
        raise UserInputError("--long-poll must be between 0 and 45 seconds (the tinker SDK gives up on a "
                             "poll at 45)")
    if not args.max_body_mb > 0 or not args.seq_gap_timeout > 0:
        raise UserInputError("--max-body-mb and --seq-gap-timeout must be positive")
    for flag, _, _ in LIMITS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise UserInputError(f"{flag} must be a positive integer, got {value}")
    if args.max_store_bytes is not None and args.max_store_bytes < 1:
        raise UserInputError(f"--max-store-bytes must be a positive integer, got {args.max_store_bytes}")
    for flag in ("--header-timeout", "--body-timeout", "--sweep-interval"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not 0 < value < float("inf"):
            raise UserInputError(f"{flag} must be a positive number of seconds, got {value}")
    for url in args.vllm_url:
        if not url.startswith(("http://", "https://")):
            raise UserInputError(f"--vllm-url {url!r} is not an http(s) URL")
    if args.sampler == "vllm" and not args.vllm_url:
        check_python(args.vllm_python)
    for name in args.models:
        resolve_model_path(name)
    import torch

    try:
        torch.device(args.device if args.device != "auto" else "cpu")
    except (RuntimeError, ValueError):
        raise UserInputError(f"--device {args.device!r} is not a device (auto, cpu, cuda, cuda:N or "
                             "mps)") from None


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = ("is in use by another program" if e.errno == errno.EADDRINUSE
               else f"cannot be used: {e.strerror or e}")
        raise UserInputError(f"{host}:{port} {why} (pick another --port, or 0 for any free one)") from None
    return sock


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_args(args)
    keys, generated = api_keys(args)
    for k in keys:
        if not k.startswith("tml-"):
            print(f"warning: key {k[:6]}... does not start with 'tml-'; the tinker SDK refuses to send such "
                  "keys", file=sys.stderr)
    config = config_from_args(args, keys)
    sock = listen(args.host, args.port)  # once every option is known to be good

    import uvicorn

    from polyrl.serve.app import create_app, read_timeout_protocol
    from polyrl.serve.server import Server

    server = Server(config)
    if server.config.preload:
        try:
            server.bases.preload()
        except ValueError as e:  # a model directory that holds no model
            raise UserInputError(str(e)) from None
    family = sock.family
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if family == socket.AF_INET6 else host}:{port}"
    if not _is_loopback(host):
        print(f"warning: listening on {host}, reachable from other machines; anyone with a key can train "
              "and sample here", file=sys.stderr)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                if generated:
                    print(f"API key: {keys[0]}  (pass api_key=... or set TINKER_API_KEY)", flush=True)
                print(f"polyrl serve listening on {url}", flush=True)

    cfg = server.config
    config = uvicorn.Config(create_app(server), log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=3, timeout_keep_alive=75,
                            http=read_timeout_protocol(cfg.header_timeout_s, cfg.body_timeout_s))
    _Server(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="polyrl serve",
                                description="Serve polyrl's local engine over Tinker's HTTP protocol.")
    add_arguments(p)
    try:
        run(p.parse_args(argv))
    except UserInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
