"""Engine integrations: leaves over the core, each behind its optional extra.

- `kvoffload.integrations.transformers` (the ``transformers`` extra): a
  paged-KV engine for Hugging Face ``transformers`` causal LMs of the Llama architecture.
- `kvoffload.integrations.vllm` (the ``vllm`` extra): a vLLM KV connector
  driven by kvoffload's scheduler.

The core never imports this package; importing an integration without its extra raises an
``ImportError`` that names the extra. kvoffload is not on a public index: install an extra
from a clone, ``pip install '.[transformers]'`` in the repository's root.
"""
