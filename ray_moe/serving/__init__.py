"""Serving generation inside the shard actors: the model host (data-parallel attention, paged KV cache), the per-rank generation step, sampling, and the driver-side continuous-batching scheduler."""
