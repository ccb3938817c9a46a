"""Serve one typed `WorkerCall` on a `Worker` (shared by both executors)."""

from __future__ import annotations

import os
from typing import Any

from paged.runner.executor.messages import (
    AddLoRA,
    CheckHealth,
    Crash,
    DetermineAvailableMemory,
    ExecuteModel,
    GetKVCacheSpec,
    InitializeFromConfig,
    ListLoRAs,
    RemoveLoRA,
    SampleTokens,
    Shutdown,
    WorkerCall,
    kv_config_from_wire,
)
from paged.runner.worker import Worker


def serve_call(worker: Worker, call: WorkerCall) -> Any:
    """Run `call` on `worker` and return its result."""
    match call:
        case ExecuteModel(scheduler_output=so):
            return worker.execute_model(so)
        case SampleTokens(grammar_output=grammar):
            return worker.sample_tokens(grammar)
        case GetKVCacheSpec():
            return worker.get_kv_cache_spec()
        case DetermineAvailableMemory():
            return worker.determine_available_memory()
        case InitializeFromConfig(kv_cache_config=wire):
            worker.initialize_from_config(kv_config_from_wire(wire))
            return None
        case CheckHealth():
            worker.check_health()
            return None
        case AddLoRA(spec=spec):
            return worker.add_lora(spec)
        case RemoveLoRA(name=name):
            return worker.remove_lora(name)
        case ListLoRAs():
            return worker.list_loras()
        case Shutdown():
            worker.shutdown()
            return None
        case Crash(exit_code=code):
            os._exit(code)
    raise ValueError(f"unknown worker call {type(call).__name__}")
