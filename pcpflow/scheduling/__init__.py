"""What runs when: ``workload`` (requests from configs and traces), ``scheduler`` (continuous
batching, chunked prefill, drafts), ``kv_cache`` (the block allocator), ``batch`` (the
global batch a step emits).
"""
