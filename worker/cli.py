"""``splitserve worker``: run one reference worker (torch model or sim engine).

Flags are those of docs/worker.md, "Command lines the Helm chart renders"; each also reads
``SPLITSERVE_<FLAG_UPPER_SNAKE>`` from the environment (the flag wins). When the worker is ready
it prints one line holding its URL; SIGTERM/SIGINT drain it: deregister, refuse new requests,
let running ones and pending KV transfers finish for up to ``--drain-timeout`` seconds, abort
what is left, free every block, close the sockets, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from protocol.named_models import gguf_source_path, is_gguf_source, is_named_model

log = logging.getLogger("splitserve.worker")

__all__ = ["add_arguments", "run", "build_server"]

# Tokenizer vocabulary of each preset, for the sim engine, which must not import torch (and
# worker.presets does). Kept equal to worker.presets.PRESETS[*].vocab_size by a test.
SIM_PRESET_VOCAB = {"tiny": 261, "1b": 128256, "8b": 128256}
SIM_PRESET_MAX_LEN = {"tiny": 8192, "1b": 131072, "8b": 8192}


def _env(name: str, default):
    return os.environ.get("SPLITSERVE_" + name.upper().replace("-", "_"), default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    def add(flag: str, default=None, **kw):
        name = flag.lstrip("-")
        env = "SPLITSERVE_" + name.upper().replace("-", "_")
        kw["help"] = (kw.get("help", "") + f" [env {env}]").strip()
        p.add_argument(flag, default=_env(name, default), **kw)

    add("--role", "both", choices=["context", "generation", "both"],
        help="which leg(s) of a disaggregated request this worker serves")
    add("--host", "127.0.0.1", help="bind address for HTTP and KV-event sockets")
    add("--port", 8001, type=int, help="HTTP port (0 = pick a free one)")
    add("--model", "tiny", help="preset name (tiny, 1b, 8b), named GGUF model (smollm2-135m), "
                                "path/to/file.gguf, or a Hugging Face-format directory")
    add("--cache-dir", None, help="where GGUF models are kept converted (default "
                                  "$XDG_CACHE_HOME/splitserve or ~/.cache/splitserve)")
    add("--engine", "torch", choices=["torch", "sim"], help="torch model or simulated engine")
    add("--device", None, choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    add("--dtype", None, choices=["float32", "bfloat16"],
        help="default: float32 on cpu, bfloat16 on cuda")
    add("--attention-backend", "auto", choices=["auto", "triton", "torch"],
        help="attention over the paged KV cache: triton kernels reading blocks in place, or torch "
             "(gather + SDPA); auto = triton on CUDA, torch on the CPU")
    add("--async-scheduling", "auto", choices=["auto", "on", "off"],
        help="torch engine: plan and prepare step k+1 while step k runs on the device, feeding its "
             "tokens on the device (a stop on EOS/stop text then costs one discarded step); auto = on "
             "for a single-rank worker on CUDA, off on the CPU and with --tp-size/--pp-size > 1")
    add("--block-size", 16, type=int, help="tokens per KV block (= the routing block size)")
    add("--kv-namespace", None, help="cache namespace salted into this worker's block keys "
        "(= the cluster's routing.namespace; its /kv_snapshot keys are trusted only when equal)")
    add("--num-blocks", None, type=int,
        help="KV blocks in the pool (default: sized from memory; sim: 4096)")
    add("--max-batch-size", 64, type=int, help="sequences per engine step")
    add("--max-num-tokens", 2048, type=int, help="token budget per step (chunked prefill)")
    add("--kv-events-port", 0, type=int, help="ZMQ PUB port for KV events (0 = pick free)")
    add("--kv-replay-port", 0, type=int, help="ZMQ ROUTER replay port (0 = pick free)")
    add("--advertise-host", None, help="host name put in URLs this worker advertises")
    add("--coordinator-url", None, help="register with this coordinator (TTL heartbeats); with "
        "coordinator replicas, all of them, comma separated")
    add("--cluster-uri", None, help="register in etcd instead: etcd://host:port[,etcd://…] "
        "(a key on a lease, as TensorRT-LLM workers do; the coordinator watches it)")
    add("--otlp-traces-endpoint", None, help="export OpenTelemetry traces over OTLP/HTTP to this "
        "URL (e.g. http://otel-collector:4318/v1/traces); each request continues the caller's "
        "W3C traceparent")
    add("--cluster-name", "", help="disagg_cluster.cluster_name of the cluster to join in etcd")
    add("--register-ttl", 30.0, type=float, help="registration TTL in seconds (etcd: the lease, "
        "upstream's inactive_timeout_sec)")
    add("--transfer-agent", "auto", choices=["auto", "nixl", "shm", "tcp"],
        help="KV transfer agent for disaggregated requests")
    add("--transfer-port", 0, type=int, help="KV transfer control port (0 = pick free)")
    add("--transfer-timeout", 120.0, type=float,
        help="seconds a generation_only request waits for its KV (generation_first: including "
             "the context worker's prefill) before it fails")
    add("--transfer-pipeline", "on", choices=["on", "off"],
        help="context side sends each finished prefill chunk's blocks while the next chunk "
             "computes (on), or everything after the prefill (off)")
    add("--transfer-prepped", "auto", choices=["auto", "on", "off"],
        help="prepared NIXL descriptor lists (merge runs contiguous on both sides); auto = on "
             "for nixl")
    add("--transfer-spin-us", None, type=float,
        help="µs a KV-transfer control listener busy-polls (GIL released) where a message is "
             "expected soon (a posted receive's result; a context_first receive) instead of "
             "sleeping; 0 = never (the default: not yet measured on a GPU host)")
    add("--tp-size", 1, type=int, help="tensor-parallel size")
    add("--pp-size", 1, type=int, help="pipeline-parallel size")
    add("--sim-prefill-us-per-token", 20.0, type=float,
        help="sim engine: prefill cost per uncached prompt token (µs)")
    add("--sim-decode-us-per-step", 5000.0, type=float,
        help="sim engine: cost of one batched decode step (µs)")
    add("--sim-prefill-us-per-token-per-kctx", 0.0, type=float,
        help="sim engine: extra prefill cost per token per 1000 tokens of context before it (µs)")
    add("--sim-decode-us-per-seq", 0.0, type=float,
        help="sim engine: extra decode-step cost per decoding sequence (µs)")
    add("--sim-decode-us-per-ctx-token", 0.0, type=float,
        help="sim engine: extra decode-step cost per context token attended to (µs)")
    add("--sim-prefix-reuse", "on", choices=["on", "off"],
        help="sim engine: off = publish KV events but never reuse a cached block (a fault "
             "injection for the routing diagnostics)")
    add("--pin-timeout", 60.0, type=float,
        help="seconds a context request's KV stays pinned waiting for its transfer")
    add("--transfer-claim-timeout", 10.0, type=float,
        help="context side: seconds after the answer within which a generation worker must claim "
             "the pinned KV (it does so on accepting the request), else it is freed; 0 = off")
    add("--drain-timeout", 25.0, type=float,
        help="on SIGTERM, seconds to let running requests and pending KV transfers finish "
             "(new requests get 503) before aborting them")
    add("--disagg-protocol", "trtllm", choices=["trtllm", "vllm", "sglang"],
        help="engine protocol this worker speaks (worker/engine_protocols.py): trtllm "
             "disaggregated_params, vllm kv_transfer_params, sglang bootstrap rendezvous "
             "(vllm and sglang: sim engine only)")
    add("--bootstrap-port", 0, type=int,
        help="sglang protocol, context role: the bootstrap server's port (0 = pick a free one)")
    add("--log-level", "INFO", help="logging level")
    add("--log-format", "text", choices=["text", "json"],
        help="log lines as text or one JSON object per line (as the cluster's log_format)")


# ---------------------------------------------------------------------------------- building
def _sim_tokenizer(model: str):
    """The model's tokenizer without importing torch (presets: the byte-level tokenizer)."""
    from protocol.tokenizer import ByteTokenizer, HFTokenizer

    path = Path(model)
    if model in SIM_PRESET_VOCAB and not path.is_dir():
        return ByteTokenizer(vocab_size=SIM_PRESET_VOCAB[model]), SIM_PRESET_MAX_LEN[model]
    if is_gguf_source(model) and not path.is_dir():
        from protocol.gguf_metadata import gguf_metadata
        from protocol.gguf_tokenizer import gguf_tokenizer

        meta = gguf_metadata(gguf_source_path(model))
        arch = meta.get("general.architecture")
        return gguf_tokenizer(meta), int(meta.get(f"{arch}.context_length") or 1 << 20)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(SIM_PRESET_VOCAB)}) "
                         f"nor a directory")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    max_len = int(cfg.get("max_position_embeddings") or 1 << 20)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        return ByteTokenizer(vocab_size=max(261, int(cfg.get("vocab_size") or 261))), max_len
    tcfg = {}
    if (path / "tokenizer_config.json").is_file():
        tcfg = json.loads((path / "tokenizer_config.json").read_text())
    gen = {}
    if (path / "generation_config.json").is_file():
        gen = json.loads((path / "generation_config.json").read_text())
    eos = gen.get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    from protocol.prompt import chat_template_of
    return HFTokenizer.from_json(tj.read_text(), tcfg, chat_template=chat_template_of(path),
                                 extra_eos_token_ids=extra), max_len


def _ns_seed(args) -> int:
    from router.block_keys import salt_seed

    ns = getattr(args, "kv_namespace", None)
    return salt_seed(ns)


def _build_engine(args, kv_connector=None):
    if args.tp_size < 1 or args.pp_size < 1:
        raise ValueError(f"--tp-size and --pp-size must be >= 1, got {args.tp_size}, {args.pp_size}")
    if args.engine == "sim":
        from worker.sim import SimEngine

        tok, max_len = _sim_tokenizer(args.model)
        return SimEngine(tok, num_blocks=args.num_blocks or 4096, block_size=args.block_size,
                         ns_seed=_ns_seed(args),
                         max_model_len=max_len, max_batch_size=args.max_batch_size,
                         max_num_tokens=args.max_num_tokens,
                         prefill_us_per_token=args.sim_prefill_us_per_token,
                         decode_us_per_step=args.sim_decode_us_per_step,
                         prefill_us_per_token_per_kctx=args.sim_prefill_us_per_token_per_kctx,
                         decode_us_per_seq=args.sim_decode_us_per_seq,
                         decode_us_per_ctx_token=args.sim_decode_us_per_ctx_token,
                         prefix_reuse=args.sim_prefix_reuse != "off",
                         pin_timeout_s=args.pin_timeout)
    if args.tp_size != 1 or args.pp_size != 1:
        if args.async_scheduling == "on":
            raise ValueError("--async-scheduling on needs a single-rank worker (its tokens are fed on the "
                             f"device); found --tp-size {args.tp_size} --pp-size {args.pp_size}")
        # One process per rank; this one is rank 0 (worker/parallel/engine.py; docs/worker.md, "Multi-rank internals").
        from worker.parallel.engine import build_parallel_engine

        return build_parallel_engine(
            args.model, tp_size=args.tp_size, pp_size=args.pp_size, device=args.device,
            dtype=args.dtype, num_blocks=args.num_blocks, block_size=args.block_size,
            max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
            pin_timeout_s=args.pin_timeout, log_level=args.log_level, cache_dir=args.cache_dir,
            kv_connector=kv_connector)
    import torch

    from worker.engine import TorchEngine
    from worker.loader import load_model, resolve_device
    from worker.runner import ModelRunner, kv_bytes_per_block

    device = resolve_device(args.device)
    model, tok, cfg = load_model(args.model, device=device, dtype=args.dtype, cache_dir=args.cache_dir)
    num_blocks = args.num_blocks
    per_block = kv_bytes_per_block(cfg, args.block_size, model.dtype)
    if not num_blocks:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.85)
        else:
            budget = 1 << 30
        max_blocks = -(-cfg.max_position_embeddings // args.block_size) * args.max_batch_size
        num_blocks = max(16, min(budget // per_block, max_blocks))
    runner = ModelRunner(model, num_blocks, args.block_size, device=device, dtype=model.dtype,
                         attention_backend=args.attention_backend)
    log.info("torch engine: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB), %s attention", args.model,
             device, str(model.dtype).removeprefix("torch."), num_blocks, args.block_size,
             num_blocks * per_block / 2**20, runner.attention_backend)
    return TorchEngine(runner, tok, max_batch_size=args.max_batch_size,
                       max_num_tokens=args.max_num_tokens, pin_timeout_s=args.pin_timeout,
                       ns_seed=_ns_seed(args), kv_connector=kv_connector,
                       async_scheduling={"on": True, "off": False}.get(args.async_scheduling))


def build_server(args):
    """Engine + KV-event publisher + HTTP server from parsed flags (not started)."""
    from worker.kv_events import KvEventPublisher
    from worker.server import WorkerServer

    if args.cluster_uri:
        if args.coordinator_url:
            raise ValueError("give --coordinator-url (register with the coordinator) or "
                             "--cluster-uri (register in etcd), not both")
        from protocol.cluster_store import etcd_endpoints
        etcd_endpoints(args.cluster_uri)   # ValueError says what was expected

    # argparse checks choices on the command line only; values from the environment land here.
    for name, choices in (("role", ("context", "generation", "both")), ("engine", ("torch", "sim")),
                          ("device", ("cpu", "cuda", None)), ("dtype", ("float32", "bfloat16", None)),
                          ("transfer_agent", ("auto", "nixl", "shm", "tcp")),
                          ("attention_backend", ("auto", "triton", "torch")),
                          ("async_scheduling", ("auto", "on", "off")),
                          ("sim_prefix_reuse", ("on", "off")),
                          ("disagg_protocol", ("trtllm", "vllm", "sglang"))):
        if getattr(args, name) not in choices:
            raise ValueError(f"--{name.replace('_', '-')} must be one of "
                             f"{[c for c in choices if c]}, got {getattr(args, name)!r}")
    for name in ("block_size", "max_batch_size", "max_num_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise ValueError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.transfer_claim_timeout < 0:
        raise ValueError(f"--transfer-claim-timeout must be >= 0, got "
                         f"{args.transfer_claim_timeout}")
    if args.disagg_protocol != "trtllm" and args.engine != "sim":
        raise ValueError(f"--disagg-protocol {args.disagg_protocol} is implemented for --engine sim "
                         f"only (its KV moves through the sim receiver), got --engine {args.engine}")
    advertise = args.advertise_host
    if advertise is None and args.host in ("0.0.0.0", "::", ""):
        import socket
        advertise = socket.gethostname()
    name = args.model if args.model in SIM_PRESET_VOCAB or is_named_model(args.model) \
        else Path(args.model).name or args.model
    # The torch engine's KV moves through transfer/; the connector is bound (and its transceiver
    # built over the engine's pool) by the engine's constructor. The sim engine has its own.
    conn = build_kv_connector(args, name, advertise) if args.engine == "torch" else None
    engine = _build_engine(args, conn)
    publisher = KvEventPublisher(host=args.host, pub_port=args.kv_events_port,
                                 replay_port=args.kv_replay_port, advertise_host=advertise)
    return WorkerServer(engine, model_name=name, role=args.role, host=args.host, port=args.port,
                        advertise_host=advertise, publisher=publisher,
                        coordinator_url=args.coordinator_url, register_ttl_s=args.register_ttl,
                        cluster_uri=args.cluster_uri, cluster_name=args.cluster_name,
                        otlp_traces_endpoint=args.otlp_traces_endpoint,
                        transfer_info=conn.server_info() if conn else None,
                        ctx_info_endpoint=conn.endpoint if conn else None,
                        engine_protocol=args.disagg_protocol, bootstrap_port=args.bootstrap_port)


def transfer_config(args, advertise: str | None):
    """The one place worker flags become a ``transfer.session.TransferConfig``."""
    from transfer.session import TransferConfig

    return TransferConfig(agent=args.transfer_agent, host=args.host, advertise_host=advertise,
                          port=args.transfer_port, send_timeout_s=args.pin_timeout,
                          recv_timeout_s=args.transfer_timeout,
                          claim_timeout_s=getattr(args, "transfer_claim_timeout", 10.0),
                          pipeline=getattr(args, "transfer_pipeline", "on") == "on",
                          prepped=getattr(args, "transfer_prepped", "auto"),
                          spin_s=None if getattr(args, "transfer_spin_us", None) is None
                          else args.transfer_spin_us * 1e-6)


def build_kv_connector(args, model_name: str, advertise: str | None):
    """The torch engine's KV connector (worker/kv_connector_transfer.py), not bound yet: pass it
    to the engine's constructor, which builds its transceiver — registering the runner's K/V pool
    with the selected agent and serving the control endpoint that /server_info advertises as
    ``disaggregated_params.ctx_info_endpoint`` (one per rank for a multi-rank engine)."""
    from worker.kv_connector_transfer import TransferKvConnector, transceiver_for

    cfg = transfer_config(args, advertise)
    return TransferKvConnector(lambda engine: transceiver_for(engine, cfg, role=args.role,
                                                              model_name=model_name))


async def _serve(args) -> int:
    try:
        server = build_server(args)
    except (ValueError, OSError) as e:
        print(f"splitserve worker: {e}", file=sys.stderr)
        return 2
    try:
        url = await server.start()
    except OSError as e:
        print(f"splitserve worker: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        await server.stop()
        return 2
    stop, hard = asyncio.Event(), asyncio.Event()

    def on_signal():
        if stop.is_set():  # a second signal skips the rest of the drain
            hard.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if hasattr(server.engine, "on_fatal"):  # a multi-rank worker lost a rank: stop, no drain
        server.engine.on_fatal = lambda: (stop.set(), hard.set())
    info = server.server_info_dict()
    print(f"splitserve worker ready at {url} (role={info['role']} engine={info['engine']} "
          f"model={info['model']} kv_events={info['kv_events']['publisher']})", flush=True)
    await stop.wait()
    log.info("shutting down: draining for up to %.1fs", args.drain_timeout)
    drain = asyncio.create_task(server.drain(args.drain_timeout))
    abort = asyncio.create_task(hard.wait())
    await asyncio.wait({drain, abort}, return_when=asyncio.FIRST_COMPLETED)
    for t in (drain, abort):
        t.cancel()
    await server.stop()
    if server.engine.kv_connector is not None:   # after the engine stopped: in-flight writes end
        await server.engine.kv_connector.close()
    return getattr(server.engine, "exit_code", 0)


def run(args) -> int:
    from protocol import logs
    logs.setup(args.log_level, args.log_format)
    try:
        import uvloop
        return uvloop.run(_serve(args))
    except ImportError:
        return asyncio.run(_serve(args))
