"""kconvert: stream-convert Kimi-K2 family MoE checkpoints shard by shard."""

__version__ = "0.1.0"
