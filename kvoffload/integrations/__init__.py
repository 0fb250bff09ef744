"""Engine integrations: leaves over the core, each behind its optional extra.

- `kvoffload.integrations.transformers` (``pip install 'kvoffload[transformers]'``): a
  paged-KV engine for Hugging Face ``transformers`` causal LMs of the Llama architecture.
- `kvoffload.integrations.vllm` (``pip install 'kvoffload[vllm]'``): a vLLM KV connector
  driven by kvoffload's scheduler.

The core never imports this package; importing an integration without its extra raises an
``ImportError`` that names the extra.
"""
