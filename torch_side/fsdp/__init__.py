"""The FSDP core: what ``fully_shard`` builds and runs (docs/fsdp.md).

Units and their groups (``fsdp_model``, ``fsdp_unit``, ``fsdp_state``, ``unit_builder``,
``expert_units``), the parameter groups and their buffers (``param_group``, ``group_weights``,
``group_grads``, ``group_buffers``, ``flat_layout``, ``bucket_allocator``, ``plane_bucket``), the
weight formats' codecs and refresh (``weight_codecs``, ``batched_refresh``,
``distributed_quantize``), the gradient path (``grad_reducer``, ``optimizer``), scheduling
(``overlap``, ``execution_order``, ``precompiling``), configuration (``policy``, ``strategy``,
``init_sync``, ``param_guard``) and the model's state dicts (``state_dict``, ``sharded_state``).
Bytes move only through ``torch_side.comm``; files are written by ``torch_side.checkpoint``.
The public names are exported by ``torch_side`` itself.
"""
