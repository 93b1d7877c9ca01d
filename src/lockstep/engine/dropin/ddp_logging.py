"""`_get_ddp_logging_data()` of the drop-in class: torch's private debugging dict, from lockstep's facts.

The keys tools read (Lightning reads `can_set_static_graph` at teardown): the model and run, the flags,
the bucket layout (sizes in bytes; after the rebuild, parameter indices), the communication hook's name
(`comm_hook`, the hook's __qualname__ as torch's register_comm_hook logs it), errors, and
`can_set_static_graph`, present as torch has it: 0 once two synced forwards left different parameters
unused (with find_unused_parameters), absent while the graph looked static. stats() has more.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lockstep.engine.buckets.reducer import Reducer


def logging_data(ddp: Any) -> dict[str, Any]:
    """The dict for the DistributedDataParallel `ddp` (its engine, flags and recorded hook and error)."""
    engine = ddp._engine
    error = ddp.__dict__.get("_logged_error", "")
    data: dict[str, Any] = {
        "module_name": type(ddp.module).__name__,
        "world_size": engine.world,
        "rank": engine.rank,
        "iteration": engine.reducer.stats.steps,
        "static_graph": int(ddp.static_graph),
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "is_multi_device_module": int(ddp.is_multi_device_module),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "backend_name": str(dist.get_backend(ddp.process_group)),
        "has_error": int(bool(error)),
        "error": error,
        **_layout_logging(engine.reducer),
    }
    hook = ddp.__dict__.get("_comm_hook_name")
    if hook is not None:
        data["comm_hook"] = hook
    if not engine.reducer.graph_static:
        data["can_set_static_graph"] = 0
    return data


def _layout_logging(reducer: Reducer) -> dict[str, Any]:
    """torch's logging keys for the bucket layout: sizes in bytes, and after the rebuild parameter indices."""
    keys: dict[str, Any] = {
        "bucket_sizes": ", ".join(str(b.nbytes) for b in reducer.initial_layout),
        "has_rebuilt_buckets": int(reducer.rebuilt),
    }
    if reducer.rebuilt:
        keys["rebuilt_bucket_sizes"] = ", ".join(str(b.nbytes) for b in reducer.layout)
        keys["rebuilt_per_bucket_param_indices"] = ", ".join(
            " ".join(map(str, b.param_indices)) for b in reducer.layout
        )
    return keys
