"""Engine integrations: leaves over the core, each behind its optional extra.

- `kvoffload.integrations.transformers` (``pip install 'kvoffload[transformers]'``): a
  paged-KV engine for Hugging Face ``transformers`` causal LMs of the Llama architecture.

The core never imports this package; importing an integration without its extra raises an
``ImportError`` that names the extra.
"""
