"""vllm-cache-exporter: is vLLM's prefix cache doing its job, for whom, and since when."""

__version__ = "0.1.0"
