"""TensorRT-LLM argument names an upstream disaggregated config may carry, by where they come from.

Accepted and kept as given (never interpreted) so that every upstream config file loads unchanged,
while a name in none of these sets is a typo and an error (`coordinator/config_upstream.py`).

Source: NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` at commit
0004396720054fd8e205cbf616f21f0b57c6b412 (a main-branch snapshot of the 1.3 line: it schedules
removals "in release 1.4", `TorchLlmArgs` is the only LLM-args class, `LlmArgs = TorchLlmArgs`),
every pydantic field of `BaseLlmArgs`,
`TorchLlmArgs` and `KvCacheConfig`; plus `tensorrt_llm/commands/serve.py` `get_llm_args` (the
`trtllm-serve` flags a server section may set) and `tensorrt_llm/llmapi/disagg_utils.py`
`extract_disagg_cfg` at commit 0228a71223416496ff056a157936bad2e42c762f (the disaggregated
server's own keys, which `ClusterConfig` declares field by field).
To refresh: read those classes' fields and replace the three `_CURRENT_*` sets; names that drop out
move to the `_LEGACY_*` sets, because configs written for older releases still carry them.
"""
from __future__ import annotations

__all__ = ["UPSTREAM_ENGINE_ARGS", "UPSTREAM_KV_CACHE_ARGS", "SOURCE_COMMIT"]

SOURCE_COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"

# BaseLlmArgs fields (llm_args.py `class BaseLlmArgs`).
_CURRENT_BASE_LLM_ARGS = frozenset({
    "backend", "batched_logits_processor", "cache_transceiver_config", "context_parallel_size",
    "cp_config", "custom_tokenizer", "decoding_config", "dtype", "enable_attention_dp",
    "enable_chunked_prefill", "enable_energy_metrics", "enable_lm_head_tp_in_adp",
    "enable_lora", "env_overrides", "gather_generation_logits", "gpus_per_node",
    "guided_decoding_backend", "iter_stats_max_iterations", "kv_cache_compression_config",
    "kv_cache_config", "load_format", "lora_config", "max_batch_size", "max_beam_width",
    "max_input_len", "max_num_tokens", "max_seq_len", "model", "model_kwargs",
    "moe_cluster_parallel_size", "moe_expert_parallel_size", "moe_tensor_parallel_size",
    "mpi_session", "num_postprocess_workers", "num_serve_frontends", "orchestrator_type",
    "otlp_traces_endpoint", "peft_cache_config", "perf_metrics_max_requests",
    "perf_metrics_output_dir", "pipeline_parallel_size", "post_processor_hook",
    "postprocess_tokenizer_dir", "pp_partition", "prometheus_metrics_config",
    "reasoning_parser", "request_stats_max_iterations", "return_perf_metrics", "revision",
    "scheduler_config", "skip_tokenizer_init", "sparse_attention_config", "speculative_config",
    "telemetry_config", "tensor_parallel_size", "tokenizer", "tokenizer_mode",
    "tokenizer_revision", "trust_remote_code"
})

# TorchLlmArgs' own fields (llm_args.py `class TorchLlmArgs(BaseLlmArgs)`).
_CURRENT_TORCH_LLM_ARGS = frozenset({
    "allreduce_strategy", "attention_dp_config", "attn_backend", "backend",
    "batch_wait_max_tokens_ratio", "batch_wait_timeout_iters", "batch_wait_timeout_ms",
    "checkpoint_format", "checkpoint_io_policy", "checkpoint_loader", "cuda_graph_config",
    "disable_mm_encoder", "disable_overlap_scheduler", "dwdp_config", "enable_autotuner",
    "enable_early_first_token_response", "enable_encoder_decoder_mixed_cuda_graph",
    "enable_in_graph_sampling", "enable_iter_perf_stats", "enable_iter_req_stats",
    "enable_layerwise_nvtx_marker", "enable_low_latency_host_dispatch", "enable_min_latency",
    "enable_mla_skip_correction", "enable_resource_governor",
    "enable_speculative_beam_history_d2h", "encode_only", "encoder_cuda_graph_config",
    "encoder_max_batch_size", "encoder_max_num_tokens", "force_dynamic_quantization",
    "garbage_collection_gen0_threshold", "generation_config", "gms_config",
    "kv_connector_config", "layer_wise_benchmarks_config", "load_format", "max_stats_len",
    "mla_skip_correction_threshold", "mm_encoder_only", "moe_config", "multimodal_config",
    "mx_config", "nvfp4_gemm_config", "prefill_capture_num_tokens",
    "prefill_cuda_graph_backend", "print_iter_log", "ray_placement_config",
    "ray_worker_extension_cls", "ray_worker_nsight_options", "reorder_policy_config",
    "sampler_force_async_worker", "sleep_config", "stream_interval", "torch_compile_config",
    "use_cute_dsl_bf16_bmm", "use_cute_dsl_bf16_gemm", "use_cute_dsl_blockscaling_bmm",
    "use_cute_dsl_blockscaling_mm", "use_fine_grained_sync"
})

# `trtllm-serve` flags that are not LLM-args fields: `get_llm_args(free_gpu_memory_fraction=...,
# fail_fast_on_attention_window_too_large=...)` maps them; `update_llm_args_with_extra_dict`
# accepts `hf_revision` for `revision`; `sampler_type` is in `TORCH_LLMARGS_REMOVED_ARGS` (still
# accepted on input, dropped with a warning).
_SERVE_CLI_ARGS = frozenset({
    "fail_fast_on_attention_window_too_large", "free_gpu_memory_fraction", "hf_revision",
    "sampler_type"
})

# Fields of earlier releases that current main no longer declares (the TensorRT-engine
# `TrtLlmArgs` and `PyTorchConfig` eras, 0.2x-1.2): configs written for them are still in use.
_LEGACY_ENGINE_ARGS = frozenset({
    "batching_type", "build_config", "calib_config", "cuda_graph_batch_sizes",
    "cuda_graph_max_batch_size", "cuda_graph_padding_enabled", "enable_build_cache",
    "enable_chunked_context", "enable_mixed_sampler", "enable_sleep",
    "extended_runtime_perf_knob_config", "host_cache_size", "max_draft_len",
    "max_prompt_adapter_token", "moe_backend", "num_gpus",
    "perf_metrics_max_requests_per_worker", "pytorch_backend_config", "quant_config",
    "tool_parser", "use_cuda_graph", "use_torch_sampler", "world_size"
})

# KvCacheConfig fields (llm_args.py `class KvCacheConfig(StrictBaseModel, PybindMirror)`).
_CURRENT_KV_CACHE_ARGS = frozenset({
    "attention_dp_events_gather_period_ms", "copy_on_partial_reuse", "cross_kv_cache_fraction",
    "disk_cache_path", "disk_cache_size", "dtype", "enable_block_reuse",
    "enable_kv_pool_rebalance", "enable_partial_reuse", "enable_swa_scratch_reuse",
    "event_buffer_max_size", "free_gpu_memory_fraction", "host_cache_size",
    "iteration_stats_interval", "kv_cache_event_hash_algo", "kv_events_config",
    "kv_pool_rebalance_cooldown_secs", "kv_pool_rebalance_min_sampled_kv_caches",
    "kv_pool_rebalance_ratio_threshold", "kv_pool_rebalance_target_ratio_update_interval",
    "mamba_ssm_cache_dtype", "mamba_ssm_philox_rounds", "mamba_ssm_stochastic_rounding",
    "mamba_state_cache_interval", "mamba_state_config", "max_attention_window",
    "max_gpu_total_bytes", "max_tokens", "max_util_for_resume",
    "secondary_offload_min_priority", "sink_token_length", "tokens_per_block",
    "use_kv_cache_manager_v2", "use_uvm"
})

_LEGACY_KV_CACHE_ARGS = frozenset({
    "enable_swa_reuse", "event_buffer_max_size_per_rank", "onboard_blocks"
})

UPSTREAM_ENGINE_ARGS = _CURRENT_BASE_LLM_ARGS | _CURRENT_TORCH_LLM_ARGS | _SERVE_CLI_ARGS \
    | _LEGACY_ENGINE_ARGS
UPSTREAM_KV_CACHE_ARGS = _CURRENT_KV_CACHE_ARGS | _LEGACY_KV_CACHE_ARGS
